"""A replay server for ingest benchmarks: serves one recorded watch stream, byte for byte, to anyone.

    python -m bench.replay STREAM_FILE PORT

``GET /api/v1/pods?watch=...`` answers the recorded lines (chunked, 64 KiB writes) and closes; any other
``GET /api/v1/pods`` answers an empty PodList at resourceVersion 1, so clients that list first work too.
It runs in its own process so the contenders (in the benchmark's process) are measured alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

from aiohttp import web


def make_app(stream: bytes) -> web.Application:
    async def pods(request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") not in ("1", "true"):
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": "1"}, "items": []})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(stream), 65536):
            await response.write(stream[start:start + 65536])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/api/v1/pods", pods)
    return app


def main() -> None:
    stream = Path(sys.argv[1]).read_bytes()
    web.run_app(make_app(stream), host="127.0.0.1", port=int(sys.argv[2]), print=None)


if __name__ == "__main__":
    main()
