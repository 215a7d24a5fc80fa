"""mem.activations (the bytes a micro-step's forward saves for backward) and the planner's count of
them (trainer/plan/activations.py): single process, on the CPU."""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainer.config import to_config
from trainer.layout import Degrees, Layout
from trainer.losses.objectives import NextToken
from trainer.models import build_model, resolve_model
from trainer.models.blocks import apply_checkpointing, find_blocks
from trainer.models.fused_loss import fuse_output_layer
from trainer.saved_bytes import SavedBytes
from trainer.training.loop import micro_steps


@pytest.fixture(scope="module", autouse=True)
def one_process_group(tmp_path_factory):
    """The loop sums its counts over the world: here a world of one process."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1),
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class OneRank:
    """The loop's view of a strategy on one rank: a plain backward."""
    layout = Layout(Degrees(1), rank=0)  # one rank: no group is made

    def micro_step(self, final):
        return nullcontext()

    def autocast(self):
        return nullcontext()

    def backward(self, loss, measure_memory=False):
        loss.backward()

    def memory_bytes(self):
        return {"params": 0, "grads": 0, "optim": 0, "peak": None}


def model_of(cfg, checkpointing: bool, fused_loss: bool = False) -> nn.Module:
    """As the trainer builds it (setup_model): the fused output layer, then checkpointing per block."""
    torch.manual_seed(0)
    model = build_model(cfg.model, torch.device("cpu"), cfg.peft)
    if fused_loss:
        fuse_output_layer(model, cfg.model.vocab_size)
    if checkpointing:
        apply_checkpointing(model, find_blocks(model, cfg.strategy.wrap))
    return model


def measured(cfg, seq_len: int, micro_batch: int, checkpointing: bool = False, track: bool = True,
             fused_loss: bool = False):
    """mem.activations of one step of the loop's micro_steps."""
    ids = torch.randint(0, cfg.model.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    sums = micro_steps(model_of(cfg, checkpointing, fused_loss), OneRank(), [[ids, ids]], 1, track_memory=track,
                       objective=NextToken(fused_loss))
    return sums.mem["activations"] if sums.mem is not None else None


TINY = {"model": {"name": "tiny", "seq_len": 256}}


def test_mem_activations_double_with_the_micro_batch_and_the_length_and_shrink_with_checkpointing():
    cfg = to_config(TINY)
    base = measured(cfg, 64, 2)
    assert base > 0
    assert measured(cfg, 64, 4) == pytest.approx(2 * base, rel=0.02)
    assert measured(cfg, 128, 2) == pytest.approx(2 * base, rel=0.02)
    assert measured(cfg, 64, 2, checkpointing=True) < 0.5 * base  # only the blocks' inputs are kept
    assert measured(cfg, 64, 2, track=False) is None  # not a log step: not measured


def test_parameters_and_their_casts_are_not_activations():
    layer = nn.Linear(512, 512)
    x = torch.randn(4, 512, requires_grad=True)
    with SavedBytes() as saved:
        layer(x).sum()
    assert saved.bytes == x.numel() * 4  # the input only, not the 1 MB weight
    with SavedBytes() as saved, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).sum()
    assert saved.bytes == x.numel() * 2  # the input's bf16 copy, not the weight's
    frozen = nn.Linear(512, 512).requires_grad_(False)
    with SavedBytes() as saved:
        frozen(x).sum()
    assert saved.bytes == 0  # a frozen weight (LoRA's base), saved transposed, is a parameter too
    with SavedBytes() as saved:
        WeightAsATensor.apply(x, layer.weight).sum()
    # a detached alias of a weight counts: ZeRO-3's release frees the parameter's storage, not the alias's
    assert saved.bytes == (x.numel() + layer.weight.numel()) * 4


def test_what_a_dropped_graph_saved_is_not_kept():
    """A storage saved by a graph the forward drops is freed: not counted (nor, when its address
    comes back as another storage, mistaken for that one). MoE routing drops such graphs; before,
    the planner's count of DeepSeek-V3 varied from run to run (17,644 to 18,060 bytes a token)."""
    x = torch.randn(1000, requires_grad=True)
    with SavedBytes() as saved:
        dropped = (x * 2).sin()  # sin saves its input, freed with `dropped`
        del dropped
        loss = (x * 3).sin().sum()
    saved.kept_by_functions(loss)
    assert saved.bytes == 4000


class WeightAsATensor(torch.autograd.Function):
    """Saves a weight as torch's linear_cross_entropy did: detached, a plain tensor on its storage."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight.detach())
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    from trainer.demo import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2", weights=False, max_position_embeddings=1024)


@pytest.mark.parametrize("model", ["tiny", pytest.param("qwen2", marks=pytest.mark.slow)])  # HF families: slow
def test_the_plan_counts_what_a_micro_step_keeps_at_three_lengths(model, request):
    from trainer.plan.activations import planned

    settings = TINY if model == "tiny" else {"model": {"name": "hf", "kind": "hf",
                                                       "path": str(request.getfixturevalue("qwen2"))}}
    cfg = to_config(settings)
    cfg.model = resolve_model(cfg.model)
    # the quick suite: plain, and checkpointing with the fused loss; Qwen2 (slow): all four
    options = [(False, False), (True, True)] if model == "tiny" else [(False, False), (False, True), (True, False),
                                                                      (True, True)]
    for checkpointing, fused_loss in options:
        count = planned(cfg, checkpointing, fused_loss)
        for seq_len in (64, 128, 256):
            assert count.bytes(seq_len, 2) == pytest.approx(
                measured(cfg, seq_len, 2, checkpointing, fused_loss=fused_loss), rel=0.10), (checkpointing, fused_loss)


def test_sequence_parallelism_and_the_fused_loss_lengthen_the_longest_sequence_that_fits():
    from trainer.plan import make_plan, plan_for_the_sequence

    cfg = to_config({"model": {"name": "tiny"}, "train": {"micro_batch_size": 1}})  # 4 heads: sp=4 too
    plan = make_plan(cfg, 4, 10 ** 9)
    longest = {(sp, fused, ac): n for sp, fused, ac, n in plan.long_context}
    for fused in (False, True):  # not quite 2x: Ulysses keeps one more copy of attention's output per layer
        for ac in (False, True):
            assert longest[2, fused, ac] >= 1.8 * longest[1, fused, ac] > 0
            assert longest[4, fused, ac] >= 1.8 * longest[2, fused, ac]
    assert longest[1, True, False] > longest[1, False, False]  # no [tokens, vocab] log-probabilities kept
    # strategy=auto: where nothing fits without strategy.tp (tp=4 does, its norms sequence-parallel, and is
    # faster than tp=2 with checkpointing), the fused loss first, then sequence parallelism
    tight = to_config({"model": {"name": "tiny", "seq_len": (longest[1, True, True] + 512) // 4 * 4},  # sp divides it
                       "train": {"micro_batch_size": 1}})
    nothing = make_plan(tight, 4, 10 ** 9)
    assert nothing.choice.tp > 1
    found, settings = plan_for_the_sequence(tight, 4, nothing)
    assert found.choice is not None and settings == {("strategy", "sp"): 2, ("train", "fused_loss"): False}


def profiled_backward_peak(head: nn.Linear, fused: bool, tokens: int) -> int:
    """On the CPU, torch.profiler's reading: the most bytes the backward of `head` and the loss over
    `tokens` tokens holds at once (each op's own allocations and frees, in the order the ops end)."""
    from torch.profiler import ProfilerActivity, profile

    hidden = torch.randn(1, tokens, head.in_features, dtype=head.weight.dtype, requires_grad=True)
    loss = NextToken(fused=fused).loss_sum(head, [hidden, torch.randint(0, head.out_features, (1, tokens))])[0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.end):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_the_plan_counts_the_output_layers_gradients_at_the_start_of_backward():
    """The plain loss's backward holds two fp32 [tokens, vocab] gradients at once beside everything
    kept (8 bytes a token and vocabulary entry, read by torch.profiler on the CPU): the plan counts
    them on meta and adds them to what an option needs; the fused loss holds a chunk's."""
    from trainer.plan import activation_need
    from trainer.plan.activations import planned

    cfg = to_config({"model": {"name": "tiny", "vocab_size": 4096}, "train": {"precision": "bf16"}})
    plain, fused = planned(cfg, False, False), planned(cfg, False, True)
    head = nn.Linear(cfg.model.d_model, cfg.model.vocab_size, bias=False, dtype=torch.bfloat16).requires_grad_(False)
    read = (profiled_backward_peak(head, False, 512) - profiled_backward_peak(head, False, 256)) / 256
    assert read == pytest.approx(8 * cfg.model.vocab_size, rel=0.01)
    assert plain.output_backward_per_token == pytest.approx(read, rel=0.01)
    assert 0 < fused.output_backward_per_token < plain.output_backward_per_token / 4
    assert activation_need(cfg, False, False).per_token == plain.per_token + plain.output_backward_per_token
    # with checkpointing, the larger of those gradients and one block recomputed (later in backward)
    recomputed = plain.per_token_per_layer
    assert activation_need(cfg, True, False).per_token == planned(cfg, True, False).per_token + max(
        recomputed, planned(cfg, True, False).output_backward_per_token)


def test_a_model_whose_logits_no_linear_layer_makes_is_planned_without_the_output_gradients():
    from trainer.plan.activations import output_backward_bytes

    class TiedByHand(nn.Module):  # a custom model's F.linear on its embedding: no output layer to count
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 8, device="meta")

        def forward(self, ids):
            return torch.nn.functional.linear(self.embed(ids), self.embed.weight)

    assert output_backward_bytes(TiedByHand(), 64, False, 16) == 0


def test_the_plan_divides_a_ranks_compute_by_sp_and_considers_every_sp_the_heads_allow():
    """At sp=2 a rank computes half of each row: with links and PCIe too fast to count, every
    option's step time halves. Any divisor of the heads and the world is an sp size, not only powers of 2."""
    from trainer.plan import make_plan, sequence_parallel_sizes

    fast = {"link_gbps": 1e12, "pcie_gbps": 1e12}
    one, two = (make_plan(to_config({"model": {"name": "tiny"}, "strategy": {"sp": sp}, "plan": fast}), 2, 10 ** 12)
                for sp in (1, 2))
    for alone, halved in zip(one.options, two.options):
        assert halved.step_s == pytest.approx(alone.step_s / 2, rel=1e-3), (alone.name, alone.step_s, halved.step_s)
    six_heads = to_config({"model": {"name": "tiny", "n_heads": 6, "d_model": 96, "seq_len": 96}})
    assert sequence_parallel_sizes(six_heads, 6) == [1, 2, 3, 6]
    assert sequence_parallel_sizes(six_heads, 4) == [1, 2]
    six_heads.model.seq_len = 128  # sp=3 and 6 would not divide the rows (the checks refuse them)
    assert sequence_parallel_sizes(six_heads, 6) == [1, 2]


@pytest.mark.slow  # ranks on a real gloo group
def test_at_sp_2_each_rank_keeps_about_half_and_the_plan_knows(tmp_path):
    """strategy.sp=2: rank 0's mem.activations is its own share, at most 0.55x of one rank's with the
    whole rows (Ulysses keeps one more reordered copy per layer: not exactly half), and the plan's
    count at sp=2 to the byte. One row a micro-batch: a rank's share of it is a contiguous slice,
    which, were it a view, would keep the whole row's ids and targets for backward (16 bytes a token
    of the other ranks' shares that the plan does not count)."""
    from tests.harness import case, on_ranks, records, train_cases, with_overrides
    from trainer.plan.activations import planned

    base = with_overrides(case("ddp", steps=1), model__seq_len=256, train__micro_batch_size=1)
    on_ranks(1, train_cases, {"sp1": base}, str(tmp_path))
    on_ranks(2, train_cases, {"sp2": with_overrides(base, strategy__sp=2)}, str(tmp_path))
    one, two = (records(tmp_path / name)[-1]["mem"]["activations"] for name in ("sp1", "sp2"))
    assert 0.45 * one < two <= 0.55 * one, (one, two)
    assert two == planned(to_config(base), False, False, sp=2).bytes(256, 1)


@pytest.mark.parametrize("family,alike", [("tiny", True), ("qwen2", True), pytest.param("qwen3_moe", True, marks=pytest.mark.slow),
                                          ("deepseek_v3", False), pytest.param("qwen2_sliding", False, marks=pytest.mark.slow)])
def test_two_blocks_traced_count_what_the_whole_depth_does(family, alike, tmp_path, monkeypatch):
    """The planner traces the first two of a model's blocks where all are alike and counts the
    second's saves for each one after it (plan_activations.alike_stack): the same count as a trace
    of the whole depth, with checkpointing, the fused loss, sp=2, packed rows and LoRA; a model whose
    blocks differ (DeepSeek-V3's dense first layer, Qwen2's sliding-window layers past
    max_window_layers) is traced whole."""
    from trainer.demo import make_model_dir
    from trainer.plan import activations as plan_activations

    sliding = dict(use_sliding_window=True, sliding_window=64, max_window_layers=2) if family == "qwen2_sliding" else {}
    model = {"name": "tiny", "n_layers": 5} if family == "tiny" else {"name": "hf", "kind": "hf", "path": str(
        make_model_dir(tmp_path, family.removesuffix("_sliding"), weights=False, num_hidden_layers=5, **sliding))}
    # sliding windows: refused at sp > 1 and on packed rows, so counted at sp=1 on plain rows
    data, options = ({"name": "synthetic"}, ((False, False, 1), (True, True, 1))) if sliding else (
        {"name": "chat", "packing": True}, ((False, False, 1), (True, True, 2), (False, True, 2)))
    for peft in ({}, {"name": "lora"}):
        cfg = to_config({"model": model, "peft": peft, "data": data})
        cfg.model = resolve_model(cfg.model)
        built = build_model(cfg.model, torch.device("meta"), cfg.peft)
        assert (plan_activations.alike_stack(built, find_blocks(built, cfg.strategy.wrap)) is not None) == alike
        for checkpointing, fused, sp in options:
            monkeypatch.setattr(plan_activations, "_COUNTS", {})
            two_deep = plan_activations.planned(cfg, checkpointing, fused, sp)
            with monkeypatch.context() as whole_depth:
                whole_depth.setattr(plan_activations, "_COUNTS", {})
                whole_depth.setattr(plan_activations, "alike_stack", lambda *_: None)
                whole = plan_activations.planned(cfg, checkpointing, fused, sp)
            for field in dataclasses.fields(whole):
                assert getattr(two_deep, field.name) == pytest.approx(getattr(whole, field.name), rel=1e-9, abs=1e-6), (
                    field.name, peft, checkpointing, fused, sp)
