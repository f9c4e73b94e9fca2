"""polyshard.ep: Expert parallelism: mixture-of-experts with all-to-all dispatch."""
