"""Recovery and rescaling: restore plans, key-group reassignment into a new parallelism,
compatibility checks, savepoints and offline rewrites. Depends on ``storage`` only.

(Today the runtime's driver resolves ``restore=`` itself; restore plans move here with the
recovery work.)
"""
