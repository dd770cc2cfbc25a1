"""Speed: the speed options, the fast tier, compile and its cache, CUDA graphs, pipeline lanes."""
