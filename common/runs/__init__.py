"""The tooling around runs: the `slipstream` command (cli.py), the local launcher (launch.py) and its
console (console.py), the multi-node script writer (scripts.py), the run registry (registry.py) and the
dashboard (dash/). Roles never import it: they run under it."""
