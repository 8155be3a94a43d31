"""A model spread over the nodes of a Ray cluster (`--ray ADDRESS`): the placement planned from
each node's memory before anything loads, the executor that runs each pass over the nodes'
ranges of layers, and the driver's model with no weights of its own. Imports model, weights
(each node loads its range with the loader) and the base modules; Ray only when asked for.

Bottom-up:
    placement    which node holds which layers (and experts), from each node's memory (memory.py's accounting)
    experts      spread by experts: a stage's executor asking the nodes holding a layer's experts
    ray_cluster  joining the cluster, probing its nodes, the stage actors and the RayExecutor
    driver       a Model on the driver whose layers run on the cluster, and its placement shown
"""
