"""Imported first by every Python subprocess of the tests (``support.subprocess_env`` puts this
folder on ``PYTHONPATH``): every process of a multi-process run writes the programs it compiles
to the session's compilation cache, not process 0 alone as JAX does.

On CPU, JAX's cache key holds XLA:CPU's topology fingerprint, which differs per process, so the
programs of process 1 were compiled again by every later run of the same layout (a resumed run,
`theseus launch` of the same arguments): about 7 s of CPU a run. What a process compiles is
unchanged; only where JAX keeps it. Never active outside the tests."""

import importlib.abc
import importlib.machinery
import sys


def _write_from_every_process(compiler) -> None:
    """``compiler._cache_write`` without its process-0 check (its other conditions kept)."""
    from jax._src import compilation_cache, config

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, callbacks):
        if callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return
        compilation_cache.put_executable_and_time(
            cache_key, module_name, executable, backend, int(compile_time_secs)
        )

    compiler._cache_write = cache_write


class _AfterCompilerImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_write_from_every_process` once ``jax._src.compiler`` is imported."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        assert spec is not None and spec.loader is not None, "jax._src.compiler moved"
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _write_from_every_process(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterCompilerImport())
