"""Developer tools: demo model builders, benchmarks, the fleet simulator."""
