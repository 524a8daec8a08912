"""Fleet simulation: replicas of sim/ behind a router, scaled by the operator's autoscaler or a
baseline, on one virtual clock (`superinfer simulate --fleet`, bench/fleet.py, docs/fleet.md)."""
