"""The controller's side of the wire, framework-free: the job's state
machine (:mod:`.controller`, with its recovery phases and restarts), the
pure decision of what to do about a fault (:mod:`.decide`), the registry of
ranks and node agents, the status view, and the gRPC server and client at
its edge (:mod:`.server`, :mod:`.client`)."""
