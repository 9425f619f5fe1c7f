"""Rollouts: the vLLM worker role, versioned weight publication into vLLM, the async completion
client, the GenerationController, the flow controllers (on-policy, one-step-off, fully-async) with
their simulator, and the tasks (prompt sources and verifiers) that define rewards."""
