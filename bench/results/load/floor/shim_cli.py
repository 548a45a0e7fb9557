"""The bare starlette + httpx relay (bench/floor_proxy.py) behind load.py's proxy command,
with the /healthz load.py waits for: a reference for what the server stack itself costs.
Copied to a throwaway tree as proxy/cli.py (see README.md here); not part of prefixpin."""

from __future__ import annotations

import sys

sys.path.append("/work/main")  # this repository: bench.floor_proxy, core (after the tree)

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench.floor_proxy import create_app
from prefixpin.proxy.listen.http_limits import http_options


async def healthz(request: Request) -> Response:
    return JSONResponse({"upstream": {"status": "ok"}})


def main() -> None:
    args = sys.argv[1:]
    upstream = args[args.index("--upstream") + 1]
    port = int(args[args.index("--port") + 1])
    app = create_app(upstream)
    app.router.routes.append(Route("/healthz", healthz))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                **http_options())


if __name__ == "__main__":
    main()
