"""A TCP proxy on 127.0.0.1 that delays every byte by a fixed time each way, as `tc netem delay`
would on a link (this machine's kernel has no netem): each chunk read from one side is written to
the other once its arrival time plus the delay has passed, so the delay is added once per
round trip leg and the bandwidth is the server's own.

    .venv/bin/python benchmarks/delay_proxy.py --to 127.0.0.1:PORT --delay-ms 10

prints `listening PORT` once it accepts connections, and runs until it is signalled. A round trip
through it takes twice --delay-ms more than one straight to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        while data := await reader.read(1 << 16):
            chunks.put_nowait((time.monotonic() + delay_s, data))
        chunks.put_nowait((time.monotonic() + delay_s, b""))

    async def write() -> None:
        while True:
            due, data = await chunks.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        writer.close()

    try:
        await asyncio.gather(read(), write())
    except (ConnectionError, asyncio.IncompleteReadError):
        writer.close()


async def main(target_host: str, target_port: int, delay_s: float) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w, delay_s), _pipe(server_r, client_w, delay_s))

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--to", required=True, help="HOST:PORT of the server")
    p.add_argument("--delay-ms", type=float, default=10.0, help="added to each direction")
    a = p.parse_args()
    host, port = a.to.rsplit(":", 1)
    asyncio.run(main(host, int(port), a.delay_ms / 1000))
