"""The losses a step computes, below the loop and the planner that both run them: the objectives
(next-token, DPO) and the router's load-balancing term of mixture-of-experts models."""
