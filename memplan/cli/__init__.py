"""The ``memplan`` command line (``memplan.cli.app``), and two settings of its start-up.

- **No garbage collection while the CLI's modules load.** Importing them (pydantic, typer, the
  configuration models, the engine) creates some 38,000 objects the cyclic collector tracks and that live
  as long as the process; left on, it scans them ≈ 60 times on the way (≈ 15–20 ms of a 0.3 s start-up,
  docs/benchmarks.md). It is off while they load, then ``gc.freeze()`` moves everything loaded so far to
  the permanent generation, so that later collections scan only what the command itself makes. NB: a
  reference cycle that was already garbage when the CLI was imported is then never collected (a process
  that imports the CLI, such as the test suite, keeps it; a one-off, bounded by what existed before).
- **pydantic's plugins off unless the user says otherwise.** On the first validator it builds, pydantic
  (``pydantic.plugin._loader.get_plugins``) reads the entry points of every installed distribution
  (``importlib.metadata.distributions()``: ≈ 5 ms with a hundred-odd packages installed). memplan uses no
  plugin; ``PYDANTIC_DISABLE_PLUGINS`` set by the user, even empty, is kept.
- **Unfrozen again at exit.** Frozen objects are never collected, not even by the interpreter's last
  collection at shutdown: objects of an extension imported before the CLI (the test suite imports
  triton, through peft and bitsandbytes, before ``memplan.cli``) would then outlive the interpreter,
  and nanobind, whose bindings triton uses, reports each of them at exit ("nanobind: leaked 4
  instances!", some 40 lines after pytest's summary). ``gc.unfreeze`` at exit hands them back to
  that last collection (a few ms, once, at exit).
"""

import atexit
import gc
import os


def _load_quietly() -> None:
    """Import what every command stands on with the collector off, then freeze it (see above)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import typer.main  # noqa: F401

        import memplan.api  # noqa: F401
    finally:
        gc.freeze()
        atexit.register(gc.unfreeze)
        if enabled:
            gc.enable()


os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
_load_quietly()
