"""What the benchmarks and the simulator share: workloads (synthetic arrivals and lengths, real
traces replayed), load generation against an endpoint (`superinfer bench`), replay through the
real engine on a virtual clock, the virtual device timeline of steps, goodput judged per stream,
and the records runs write. The runnable experiments live in bench/, the simulator in sim/.
"""
