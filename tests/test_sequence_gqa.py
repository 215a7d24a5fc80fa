"""Under sequence parallelism, grouped-query attention sends its key/value heads, not copies
of them for every query head (models/sequence.py, `key_value_heads_sent`): `kv_heads / sp` a rank
where they split, one a rank (each repeated sp / kv_heads times) where there are fewer than the
ranks. On 2 gloo ranks, one launch: a tiny Qwen2 in both regimes gives the whole model's logits and
gradients, and the all-to-alls and the keys attention keeps are the size of the key/value heads."""
from __future__ import annotations

from unittest import mock

import torch

from tests.harness import on_ranks
from tests.test_sequence_hf import SEQ, sharded_against_whole
from trainer.models.sequence import key_value_heads_sent

HEADS, HEAD_DIM, LAYERS, ROWS = 4, 8, 2, 2  # the tiny Qwen2 of trainer/demo.py: width 32, 4 query heads
REGIMES = {"kv_heads 2 split over 2 ranks": 2, "kv_heads 1 repeated for 2 ranks": 1}
SENT = 2  # key/value heads the all-to-all carries in both: one a rank (4 when repeated to the queries')


def test_key_value_heads_sent_follow_deepspeed_alst():
    assert key_value_heads_sent(32, 8, 4) == 8  # Llama-3-8B at sp=4: 2 a rank, not 8
    assert key_value_heads_sent(32, 8, 16) == 16  # sp=16: each key/value head twice, one a rank
    assert key_value_heads_sent(12, 6, 4) == 12  # neither divides the other: one per query head, as before
    assert key_value_heads_sent(4, 4, 2) == 4


def counted(env, paths: dict[str, str]) -> dict[str, dict]:
    """Per model folder: sharded_against_whole's differences, the elements the forward all-to-alls
    carried and the key heads SDPA was given (and keeps for backward) at sp=2."""
    return {name: counted_one(env, path) for name, path in paths.items()}


def counted_one(env, path: str) -> dict:
    from trainer.models import sequence

    sent, key_heads = [], []
    exchange, sdpa = sequence.all_to_all_single, torch.nn.functional.scaled_dot_product_attention

    def counting_exchange(output, input, group=None):
        sent.append(input.numel())
        return exchange(output, input, group=group)

    def recording_sdpa(q, k, v, *args, **kwargs):
        if sequence.active() is not None:
            key_heads.append(k.shape[1])
        return sdpa(q, k, v, *args, **kwargs)

    with mock.patch.object(sequence, "all_to_all_single", counting_exchange), \
            mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa):
        differences = sharded_against_whole(env, path)
    return {"differences": differences, "sent": sum(sent), "key_heads": set(key_heads)}


def test_grouped_query_attention_at_sp2_sends_and_keeps_only_its_key_value_heads(tmp_path):
    from trainer.demo import make_model_dir

    paths = {name: str(make_model_dir(tmp_path / str(kv), "qwen2", weights=True, num_key_value_heads=kv))
             for name, kv in REGIMES.items()}
    found = on_ranks(2, counted, paths)
    for rank, regimes in found.items():
        for name in REGIMES:
            seen = regimes[name]
            for what, difference in seen["differences"].items():  # sp=2 = the whole model (plain and packed rows)
                assert difference < 1e-5, (name, rank, what, difference)
            assert seen["key_heads"] == {SENT // 2}, (name, seen["key_heads"])  # one key/value head a rank, not 2
            # per layer and forward: queries and output (HEADS), keys and values (SENT), a rank's share of the row;
            # two forwards (plain rows, packed rows)
            per_layer = (2 * HEADS + 2 * SENT) * ROWS * SEQ // 2 * HEAD_DIM
            assert seen["sent"] == 2 * LAYERS * per_layer, (name, seen["sent"], 2 * LAYERS * per_layer)


def test_the_planner_counts_the_all_to_alls_of_the_key_value_heads_sent(tmp_path):
    """The plan's comm column at sp=2: per step, the forward's all-to-alls (queries and output of 4
    heads, keys and values of the 2 sent) and as much again in backward; once more under checkpointing."""
    from trainer.config import to_config
    from trainer.demo import make_model_dir
    from trainer.plan import make_plan

    path = make_model_dir(tmp_path, "qwen2", weights=False, num_key_value_heads=1)
    seq, micro, accum = 32, 2, 3
    cfg = to_config({"model": {"name": "hf", "kind": "hf", "path": str(path), "seq_len": seq, "vocab_size": 512},
                     "strategy": {"sp": 2}, "train": {"micro_batch_size": micro, "grad_accum_steps": accum}})
    plan = make_plan(cfg, world_size=2, gpu_memory_bytes=10**10)
    forward = (2 * HEADS + 2 * SENT) * HEAD_DIM * 4 * seq // 2 * LAYERS * micro * accum  # fp32 bytes
    for option in plan.options:
        passes = 3 if option.activation_checkpointing else 2
        assert option.comm_bytes["all_to_all"] == passes * forward, (option.name, option.comm_bytes)
