"""`python3 -m aot.serving tritonserver ARGS...`: the container's entry point (docker-compose.yml, deploy/kubernetes):
tritonserver under its supervisor (aot.serving.supervision.main), whose /ready also checks the task store
(aot.serving.store.check). The one module that puts the two rooms together: neither imports the other."""

from aot.serving.store.check import store_check_of
from aot.serving.supervision.main import main

if __name__ == "__main__":
    raise SystemExit(main(store_check_of=store_check_of))
