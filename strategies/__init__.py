"""Planning: sharding rules, candidates, search problems and solvers (imported as
``autopar.strategies``). Pure: nothing here touches devices, processes or sockets."""
