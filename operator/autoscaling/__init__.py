"""The SLO autoscaler: metrics windows, latency model and the scaling decision."""
