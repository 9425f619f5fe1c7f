"""Flow control between generation and training: `policy` and `strategies` hold the pure, deterministic
state machines of the three strategies (on-policy, one-step-off, fully-async) that decide which prompt is
generated when, which complete groups form a train batch and when weights are published (`events`: what
they exchange with a driver); `runtime` drives a policy for real with the GenerationController and the
trainer's callbacks, with a checkpointable state. `sim/` is the simulator lab, which drives the very same
policy objects in simulated time."""
