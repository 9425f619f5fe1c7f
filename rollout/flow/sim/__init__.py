"""The flow-control simulator lab: `simulator` drives the runtime's own policy objects
(rollout/flow/policy.py) through a discrete-event model of a generator pool and one trainer, in simulated
time, to predict a run's schedule, utilisation and staleness before spending hardware on it; `report`
renders its results, `calibrate` fits the timing model to a real run's metrics, `compare` sets a
prediction beside a measured run, `sweep` runs a grid of settings, and `cli` is `slipstream simulate`.
The runtime never imports this package."""
