"""A Ray cluster for a model (`--ray ADDRESS`): joining it and probing its nodes, and the placement
planned from each node's memory before anything loads. What runs on the nodes (the stages, the
passes part that drives them) is execution's. Imports model, weights (the memory check's
accounting, the load form) and the base modules; Ray only when asked for.

Bottom-up:
    placement    which node holds which layers (and experts), from each node's memory (memory.py's accounting)
    ray_cluster  joining the cluster, probing its nodes, Ray's errors classified
    driver       the placement planned for a checkpoint and shown
"""
