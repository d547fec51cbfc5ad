"""Structured-output specifications are compiled once by the server, in a worker process, within a time
limit, before the engine sees them.

Compile time grows steeply with a schema's size (1,000 optional properties: 6 s; 3,000: 100 s) and
the engine compiles on its scheduler thread, so a schema the server let through unchecked would stall
every stream. The worker is a process so that a compilation past the limit can be stopped: it is
killed (the request gets a 400 naming the limit) and a fresh worker starts. It starts with the server
and builds the compiler before the first request (about 3 s on CPU), so no request pays for that.
One compilation runs at a time; results are remembered by specification.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
from collections import OrderedDict
from multiprocessing.connection import Connection

from deltaserve.engine.structured import grammar_key, grammars_available
from deltaserve.sampling_params import StructuredOutputParams

logger = logging.getLogger("deltaserve.server")

STARTUP_TIMEOUT_S = 120.0
REMEMBERED_RESULTS = 1024
TIMEOUT_FLAG = "--structured-output-compile-timeout-s"

_Key = tuple[object, ...]


def _worker_main(model_dir: str, conn: Connection) -> None:
    """The worker: answers each specification with None (it compiles) or the error message."""
    from deltaserve.engine.structured import GrammarBackend, StructuredOutputError, grammar_vocabulary
    from deltaserve.process_name import set_process_name
    from deltaserve.tokenizer import Tokenizer

    set_process_name("dserve-grammar")
    os.nice(10)  # compiling a schema must not take CPU from generation
    tokenizer = Tokenizer.from_dir(model_dir)
    backend = GrammarBackend(lambda: grammar_vocabulary(tokenizer), [])  # builds the compiler
    conn.send("ready")
    while True:
        try:
            fields = conn.recv()
        except EOFError:
            return
        try:
            backend.grammar(StructuredOutputParams(**fields))
            conn.send(None)
        except StructuredOutputError as err:
            conn.send(str(err))
        backend.forget()  # the server remembers results; compiled grammars need not stay here


class GrammarChecker:
    def __init__(self, model_dir: str, timeout_s: float) -> None:
        self.model_dir = model_dir
        self.timeout_s = timeout_s
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False
        self._lock = asyncio.Lock()
        self._results: OrderedDict[_Key, str | None] = OrderedDict()

    def start(self) -> None:
        """Spawns the worker; it gets ready in the background."""
        if not grammars_available():
            return
        mp = multiprocessing.get_context("spawn")
        parent, child = mp.Pipe()
        self._process = mp.Process(
            target=_worker_main, args=(self.model_dir, child), name="deltaserve-grammar", daemon=True
        )
        self._process.start()
        child.close()
        self._conn, self._ready = parent, False

    async def check(self, spec: StructuredOutputParams) -> str | None:
        """None when `spec` compiles within the time limit, else what is wrong with it."""
        if spec.json_object:
            return None  # the built-in JSON grammar, compiled at start-up
        key = grammar_key(spec)
        if key in self._results:
            self._results.move_to_end(key)
            return self._results[key]
        async with self._lock:
            if key not in self._results:
                self._remember(key, await self._compile(spec))
        return self._results[key]

    def _remember(self, key: _Key, result: str | None) -> None:
        self._results[key] = result
        if len(self._results) > REMEMBERED_RESULTS:
            self._results.popitem(last=False)

    async def _compile(self, spec: StructuredOutputParams) -> str | None:
        if self._process is None:
            return "structured output needs the xgrammar package on the server (pip install deltaserve[structured])"
        if not self._ready:
            try:
                await self._receive(STARTUP_TIMEOUT_S)
            except (TimeoutError, EOFError, OSError):
                self._restart("did not start")
                return "structured output is unavailable: the grammar compiler did not start; retry"
            self._ready = True
        assert self._conn is not None
        self._conn.send(dataclasses.asdict(spec))
        try:
            return await self._receive(self.timeout_s)
        except TimeoutError:
            self._restart(f"ran past {self.timeout_s} s")
            what = {"json_schema": "JSON schema", "ebnf": "grammar"}.get(
                spec.kinds[0] if spec.kinds else "", "grammar"
            )
            return (
                f"compiling the {what} takes longer than {self.timeout_s:g} s ({TIMEOUT_FLAG}); "
                "simplify it (fewer properties or alternatives, less nesting)"
            )
        except (EOFError, OSError):
            self._restart("crashed")
            return "the grammar compiler failed on this specification"

    async def _receive(self, timeout_s: float) -> str | None:
        assert self._conn is not None
        conn = self._conn
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await asyncio.wait_for(readable, timeout_s)
        finally:
            loop.remove_reader(conn.fileno())
        message = conn.recv()
        return None if message is None or message == "ready" else str(message)

    def _restart(self, why: str) -> None:
        logger.warning("the grammar compiler worker %s; starting a new one", why)
        self.close()
        self.start()

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
            self._process = None
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
