"""The emulated API server (tests/operator/kube_emulator.py) that also writes every request
it serves to a JSON-lines file: method, path, and whether it was a watch; and, for each
create of an object whose owner reference sets blockOwnerDeletion, the authorization check
kube-apiserver's OwnerReferencesPermissionEnforcement admission plugin makes for it
(`update` on the owner's `finalizers` subresource), marked `admission`.

The RBAC test runs the real operator against it and turns the requests into
(namespace, apiGroup, resource, verb): what the operator, kopf included, really asks the API
server for. Not a cluster: see kube_emulator.py for what the emulation covers.

Run: `python tests/chart/recording_api.py --port-file FILE --requests FILE` (or with
RLFT_RECORD_REQUESTS=FILE in the environment instead of `--requests`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from kube_emulator import Emulator


@attrs.define(kw_only=True)
class RecordingEmulator(Emulator):
    """Appends one JSON line per request before serving it."""

    requests_path: Path
    sink: Any = attrs.field(default=None, init=False)

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self.sink is None:
            self.sink = open(self.requests_path, "a", buffering=1)  # noqa: SIM115
        watch = raw.query.get("watch") in ("true", "1")
        agent = raw.headers.get("User-Agent", "")
        line = {"method": raw.method, "path": raw.path, "watch": watch, "agent": agent}
        self.sink.write(json.dumps(line) + "\n")
        if raw.method == "POST" and raw.body_exists:
            # aiohttp keeps the body it read, so the emulator can read it again.
            for path in self._blocking_owners(raw.path, await raw.text()):
                check = {**line, "method": "PUT", "path": path, "admission": True}
                self.sink.write(json.dumps(check) + "\n")
        return await super().__call__(raw)

    def _blocking_owners(self, path: str, text: str) -> list[str]:
        """The owners' `finalizers` paths the admission plugin checks `update` on: one per
        owner reference with blockOwnerDeletion (the plugin maps the owner's kind to its
        resource, as done here from the served types)."""
        try:
            body = json.loads(text) if text else {}
        except ValueError:
            return []
        meta = body.get("metadata") if isinstance(body, dict) else None
        if not isinstance(meta, dict):
            return []
        where = re.search(r"/namespaces/[^/]+", path)  # an owner shares its child's namespace
        out = []
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion"):
                continue
            for rt in self.types.values():
                if rt.api_version == ref.get("apiVersion") and rt.kind == ref.get("kind"):
                    prefix = f"/apis/{rt.api_version}" if rt.group else f"/api/{rt.version}"
                    scope = where.group(0) if where and rt.namespaced else ""
                    out.append(f"{prefix}{scope}/{rt.plural}/{ref['name']}/finalizers")
        return out


async def serve(port_file: Path, requests_path: Path) -> None:
    emulator = RecordingEmulator(requests_path=requests_path)
    async with emulator, kmock.Server(emulator, port=0) as server:
        port_file.write_text(str(server.port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port-file", required=True, type=Path)
    parser.add_argument("--requests", type=Path, default=os.environ.get("RLFT_RECORD_REQUESTS"))
    args = parser.parse_args()
    if args.requests is None:
        parser.error("--requests FILE (or RLFT_RECORD_REQUESTS) is required")
    asyncio.run(serve(args.port_file, args.requests))


if __name__ == "__main__":
    main()
