"""PPO on HackMatrix in pure JAX (write-up 001): the fused learner, its population axis and benches."""
