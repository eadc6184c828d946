"""The grammars of an engine's requests, from admission to release.

A constrained request gets its compiled grammar before it reaches the scheduler: at once when
the grammar is cached, otherwise it waits here (steps go on) and joins once its compilation
has finished. Each sequence advances its own matcher on the tokens its steps produce, and
ends (stopped) once the grammar is complete. Each step, the rows that sample under a grammar
get the bitmask of the tokens they may sample next.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Callable

import numpy as np

from jaxllm.core.request import Request, RequestStatus
from jaxllm.structured_output.manager import GrammarSpec, StructuredOutputManager

logger = logging.getLogger("jaxllm")


class RequestGrammars:
    def __init__(self, manager: StructuredOutputManager,
                 finish: Callable[[Request, RequestStatus], None]):
        """finish: the scheduler's finish_request, which ends a sequence."""
        self.manager = manager
        self.finish = finish
        # requests whose grammar is still compiling: id -> (compiled future, sequences)
        self.waiting: dict[str, tuple[concurrent.futures.Future, list[Request]]] = {}

    def admit(self, request_id: str, spec: GrammarSpec, reqs: list[Request]) -> bool:
        """Give the sequences of a request their grammar: True when they may be scheduled now,
        False when they wait for its compilation (ready() hands them over). A grammar that
        failed to compile raises ValueError."""
        compiled = self.manager.compile(spec)
        if not compiled.done():
            self.waiting[request_id] = (compiled, reqs)
            return False
        self._attach(reqs, compiled.result())
        return True

    def _attach(self, reqs: list[Request], compiled) -> None:
        for req in reqs:
            req.grammar = self.manager.grammar(compiled)

    def ready(self, idle: bool) -> tuple[list[list[Request]], list[str]]:
        """The waiting requests whose compilation has finished: the sequences of those ready
        to schedule, and the ids of those whose grammar failed (aborted, the error logged; the
        server compiles before submitting, so its clients get a 400 instead). `idle`: nothing
        else runs, so wait a little for a compilation instead of spinning."""
        if not self.waiting:
            return [], []
        if idle:
            concurrent.futures.wait([f for f, _ in self.waiting.values()], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for rid, (compiled, reqs) in list(self.waiting.items()):
            if not compiled.done():
                continue
            del self.waiting[rid]
            error = compiled.exception()
            if error is not None:
                logger.error("request %s: %s", rid, error)
                for req in reqs:
                    self.finish(req, RequestStatus.FINISHED_ABORTED)
                failed.append(rid)
                continue
            self._attach(reqs, compiled.result())
            ready.append(reqs)
        return ready, failed

    def release(self, request_id: str) -> bool:
        """Forget a request still waiting for its grammar; False if it was not waiting."""
        return self.waiting.pop(request_id, None) is not None

    def advance(self, req: Request, tokens: list[int]) -> None:
        """A constrained sequence's new tokens advance its grammar; it ends (stop) once the
        grammar is complete and allows nothing more."""
        if req.status.finished and tokens[-1] == req.eos_token_id:
            tokens = tokens[:-1]  # ended by EOS, which the grammar allowed
        grammar = req.grammar
        if tokens and not grammar.accept(tokens):
            # only when other masks (allowed_token_ids, bad words) left no token the grammar allows
            logger.error("request %s sampled a token its grammar does not allow: %s",
                         req.request_id, grammar.error)
            if not req.status.finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
        elif grammar.is_terminated and (req.status == RequestStatus.FINISHED_LENGTH
                                        or not req.status.finished):
            self.finish(req, RequestStatus.FINISHED_STOPPED)  # complete at the limit: it stopped

    @staticmethod
    def constrains(out) -> bool:
        """Whether a row of the scheduled step samples under a grammar."""
        return any(out.scheduled_reqs[rid].grammar is not None for rid in out.sampling_req_ids)

    def bitmask(self, out, flight) -> np.ndarray | None:
        """The dispatched step's bitmask: the tokens each constrained row that samples in it
        may sample next; None when no row is constrained."""
        st = flight.step
        rows = []
        for i in np.nonzero(st.final)[0]:
            req = out.scheduled_reqs[st.req_ids[i]]
            if req.grammar is not None and not req.status.finished:
                rows.append((int(i), req.grammar))
        return self.manager.bitmask(rows, len(st.req_ids))
