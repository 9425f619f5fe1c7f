"""The RL objective: GRPO group advantages and the decoupled PPO loss with truncated importance
weights (trainer/rl/advantages.py, trainer/rl/loss.py), and the packing of rollouts into padded
token batches (trainer/rl/batch.py)."""
