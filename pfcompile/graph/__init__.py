"""The task graph: schedule families (their canonical per-rank orders), costs from a
profile, and the networkx task graph of one refresh cycle (`build_task_graph`)."""
