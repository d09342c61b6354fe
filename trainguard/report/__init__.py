"""A picture of a run: the run directory's event log
(:mod:`.events`, written by the launcher, the controller and the ranks while
the job runs), read back (:mod:`.timeline`) into a text summary and one PNG
(:mod:`.plot`, matplotlib) by ``trainguard report RUN_DIR``; and
``trainguard status --watch`` (:mod:`.watch`). No framework imports:
matplotlib is imported only to draw."""
