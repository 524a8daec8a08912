"""A discrete-event simulator of the engine: the real scheduler, policies and KV manager, with a cost
model standing for the device. Never imports torch."""
