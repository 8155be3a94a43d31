"""How a model runs: its executor composed of parts (compute, experts, passes), the machine they
run on, and the factory that turns the options into an executor. Imports model (the interfaces
it implements, and the math's pieces it cuts), weights (the loader), cluster (placement, joining
Ray) and the base modules; never imported by model/.

Bottom-up:
    load        how many of this process's cores other programs leave free, read as it runs
    cores       the worker pool, BLAS thread control, cutting products, heads and keys
    plans       the helper processes' protocol as data: tables, the cut into units, the registry
    helpers     the forked helper processes of a few-token pass: plans run, late units taken back
    machine     Machine: cores, BLAS, helpers and registry as one object, the environment read once
    compute     the compute part: products, heads, attention's pieces (Compute, CoreCompute)
    experts     the experts part: resident (Experts) or streamed from disk (StreamedExperts)
    remote      RemoteExperts: a cluster's experts on other nodes, this node's by its local part
    passes      the passes part: every layer here (Passes)
    executor    Executor: compute, experts and passes composed; the math's requests to each
    healing     a cluster that heals: a lost stage's layers moved to the nodes left, caches rebuilt
    stages      RayPasses: the layers on a Ray cluster's stages, the StageActor, ClusterCache
    factory     the options into an executor; load (ds2cli.load)
"""
