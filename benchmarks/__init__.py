"""Side-by-side benchmarks: scratchlm against its peers, ratios in benchmarks/results/."""
