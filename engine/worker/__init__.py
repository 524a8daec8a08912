"""The executor: runs a StepPlan on a device (model forward, paged attention, sampling, DuplexKV copies)."""
