"""Starting the ranks of a distributed run: torchrun's environment read without torch (``torchrun``), the
ranks forked from a preloaded fork server under faults and signals (``spawn``), and that server's tie to
its starter (``server_guard``). What the ranks run is the package above (``nproc``'s ``run_rank``)."""
