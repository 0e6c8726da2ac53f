"""AoT P-Tuning deployment: the `aot` command, the gRPC client and the local server launcher."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: `import aot` stays cheap for the CLI
    if name in ("Client", "InferenceError"):
        from aot import client

        return getattr(client, name)
    if name == "LocalServer":
        from aot.server import LocalServer

        return LocalServer
    raise AttributeError(name)


__all__ = ["Client", "InferenceError", "LocalServer", "__version__"]
