"""The RL objective: GRPO group advantages and the decoupled PPO loss with truncated importance
weights (trainer/rl/advantages.py, trainer/rl/loss.py), and the RL step on the training core: loss
passes and PPO mini-batches (trainer/rl/update.py)."""
