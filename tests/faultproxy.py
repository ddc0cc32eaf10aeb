"""A fault-injecting TCP proxy: `python -m tests.faultproxy --delay-ms D LISTEN=TARGET ...` forwards every
connection to each LISTEN address (host:port) to its TARGET, holding each chunk of bytes ``D`` ms in each
direction before passing it on (latency without a bandwidth cap: this kernel has no netem qdisc). Bytes
keep their order; a half-close travels on; a reset closes both sides. It prints one line per connection
opened and closed (with bytes each way), so a test can count the reconnections a fault caused."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys

CHUNK = 64 * 1024
_ids = itertools.count(1)


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, moved: list[int]
) -> None:
    """Bytes from ``reader`` to ``writer``, each chunk ``delay_s`` after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((loop.time() + delay_s, data))
        except OSError:
            pass
        queue.put_nowait((loop.time() + delay_s, b""))  # end of stream, in order after the data

    reading = asyncio.create_task(read())
    try:
        while True:
            due, data = await queue.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            moved[0] += len(data)
            await writer.drain()
    except OSError:
        return
    finally:
        reading.cancel()


async def _serve(target: tuple[str, int], delay_s: float, listen: str, source: str | None) -> asyncio.Server:
    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n, peer = next(_ids), writer.get_extra_info("peername")
        local = (source, 0) if source else None
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*target, local_addr=local), 30
            )
        except (OSError, TimeoutError) as exc:
            print(f"conn {n} {peer[0]} -> {listen}: target unreachable ({exc})", flush=True)
            writer.close()
            return
        print(f"conn {n} {peer[0]} -> {listen}: open", flush=True)
        sent, received = [0], [0]
        await asyncio.gather(
            _pipe(reader, up_writer, delay_s, sent), _pipe(up_reader, writer, delay_s, received)
        )
        for w in (writer, up_writer):
            w.close()
        print(f"conn {n} {peer[0]} -> {listen}: closed ({sent[0]} B up, {received[0]} B down)", flush=True)

    host, _, port = listen.rpartition(":")
    return await asyncio.start_server(connected, host, int(port), reuse_address=True)


async def main(routes: dict[str, tuple[str, int]], delay_s: float, source: str | None = None) -> None:
    servers = [await _serve(target, delay_s, listen, source) for listen, target in routes.items()]
    print(f"proxying {len(servers)} addresses, {delay_s * 1000:.0f} ms each way", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def parse(argv: list[str]) -> tuple[dict[str, tuple[str, int]], float, str | None]:
    parser = argparse.ArgumentParser(prog="python -m tests.faultproxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to each direction (ms)")
    parser.add_argument(
        "--source", help="the address its connections to the targets come from (for firewall rules to tell)"
    )
    parser.add_argument("routes", nargs="+", metavar="LISTEN=TARGET", help="host:port=host:port")
    args = parser.parse_args(argv)
    routes = {}
    for route in args.routes:
        listen, _, target = route.partition("=")
        host, _, port = target.rpartition(":")
        routes[listen] = (host, int(port))
    return routes, args.delay_ms / 1000, args.source


if __name__ == "__main__":
    asyncio.run(main(*parse(sys.argv[1:])))
