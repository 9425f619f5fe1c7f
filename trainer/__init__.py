"""The trainer: a DeepSeek-shaped MoE model (MLA or GQA attention, shared and routed experts with
aux-loss-free balancing), expert compute backends, expert parallelism (RDEP), the optimizer and
schedule, checkpoints, HF import/export, the RL objective and the RL training loop."""
