"""Pipeline: stages and the bounded edges between their ports, checked as they are wired.

Wiring errors are refused at once, each in one line naming both ends: an unknown stage or
port, a port type mismatch, a duplicate stage name or edge, a bad capacity. ``check()`` (run
by ``start``) adds the whole-graph checks: every required port connected, no cycle without a
feedback edge, and every feedback edge closing a cycle. Nothing runs before all pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dew_pipe.flow.errors import BuildError, check_count
from dew_pipe.flow.ports import describe, incompatibility
from dew_pipe.flow.runtime import Run
from dew_pipe.flow.stage import Stage

if TYPE_CHECKING:
    from dew_pipe.flow.metrics import FlowSnapshot


@dataclass(frozen=True)
class EdgeSpec:
    """A declared edge: ``src.src_port -> dst.dst_port`` holding at most ``capacity`` items."""

    src: str
    src_port: str
    dst: str
    dst_port: str
    capacity: int
    feedback: bool = False

    @property
    def name(self) -> str:
        return f"{self.src}.{self.src_port}->{self.dst}.{self.dst_port}"


class Pipeline:
    """A graph of stages joined by bounded queues; build it, then ``run`` or ``start`` it.

    Args:
      name: used in thread names (``flow:<name>:<stage>``), metrics and messages.

    Example:
      >>> from dew_pipe.flow import Map, Sink, Source
      >>> out = []
      >>> p = Pipeline("demo")
      >>> p.chain(Source("src", lambda: range(4), output_type=int),
      ...         Map("double", lambda x: 2 * x, input_type=int),
      ...         Sink("keep", out.append, input_type=int), capacity=2)
      >>> _ = p.run(timeout=10)
      >>> out
      [0, 2, 4, 6]
    """

    def __init__(self, name: str = "pipeline") -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise BuildError(f"pipeline name {name!r}: expected a non-empty string without ':'")
        self.name = name
        self._stages: dict[str, Stage] = {}
        self._edges: list[EdgeSpec] = []
        self._lock = threading.Lock()

    @property
    def stages(self) -> Mapping[str, Stage]:
        """Stages by name, in the order they were added."""
        return dict(self._stages)

    @property
    def edges(self) -> Sequence[EdgeSpec]:
        """Edges in the order they were connected."""
        return tuple(self._edges)

    def add(self, stage: Stage) -> Stage:
        """Add a stage; returns it. A second stage of the same name is refused."""
        if not isinstance(stage, Stage):
            raise BuildError(f"pipeline {self.name!r}: {stage!r} is not a Stage")
        existing = self._stages.get(stage.name)
        if existing is stage:
            return stage
        if existing is not None:
            raise BuildError(
                f"pipeline {self.name!r}: stage {stage.name!r} already exists "
                f"({type(existing).__name__}); do you have two stages with the same name?"
            )
        self._stages[stage.name] = stage
        return stage

    def connect(
        self, src: Stage | str, dst: Stage | str, *, capacity: int, feedback: bool = False
    ) -> EdgeSpec:
        """Connect an output port to an input port through a queue of ``capacity`` items.

        Args:
          src: a stage (added if new), its name, or ``"stage.port"``; the port may be left
            out when the stage has one output, or one required output.
          dst: likewise, for an input port.
          capacity: items the edge holds before ``put`` blocks (backpressure). Small keeps
            memory and staleness down; larger absorbs jitter between the two stages.
          feedback: this edge goes back upstream, closing a cycle (see ``dew_pipe.flow``).

        An output port may feed several edges (each item goes to all of them); an input
        port may be fed by several (items interleave; it ends when all have ended).

        Raises:
          BuildError: unknown stage or port, incompatible types, duplicate edge, bad capacity.
        """
        s, sp = self._endpoint(src, "output")
        d, dp = self._endpoint(dst, "input")
        edge = EdgeSpec(s.name, sp, d.name, dp, capacity, bool(feedback))
        check_count(f"edge {edge.name}", "capacity", capacity)
        produced, accepted = s.outputs[sp].type, d.inputs[dp].type
        reason = incompatibility(produced, accepted)
        if reason:
            raise BuildError(
                f"cannot connect stage {s.name!r} port {sp!r} ({describe(produced)}) to stage "
                f"{d.name!r} port {dp!r} ({describe(accepted)}): {reason}"
            )
        if (s.name, sp, d.name, dp) in self._edge_keys():
            raise BuildError(f"edge {edge.name} is connected twice")
        self._edges.append(edge)
        return edge

    def chain(self, *stages: Stage | str, capacity: int) -> None:
        """Connect each stage's single output to the next stage's single input."""
        for a, b in zip(stages, stages[1:], strict=False):
            self.connect(a, b, capacity=capacity)

    def check(self) -> None:
        """The whole-graph checks; ``start`` runs them. Raises BuildError on the first."""
        if not self._stages:
            raise BuildError(f"pipeline {self.name!r} has no stages")
        linked = {("input", e.dst, e.dst_port) for e in self._edges}
        linked |= {("output", e.src, e.src_port) for e in self._edges}
        for stage in self._stages.values():
            for kind, ports in (("input", stage.inputs), ("output", stage.outputs)):
                for port, spec in ports.items():
                    if spec.required and (kind, stage.name, port) not in linked:
                        raise BuildError(
                            f"stage {stage.name!r} {kind} port {port!r} ({describe(spec.type)}) "
                            f"is not connected; connect it or declare it Port(..., required=False)"
                        )
        self._check_cycles()

    def describe(self) -> str:
        """A few lines listing stages (with port types) and edges."""
        lines = [f"pipeline {self.name!r}: {len(self._stages)} stages, {len(self._edges)} edges"]
        lines += [f"  {stage!r}" for stage in self._stages.values()]
        for e in self._edges:
            extra = ", feedback" if e.feedback else ""
            lines.append(f"  {e.name} (capacity {e.capacity}{extra})")
        return "\n".join(lines)

    def start(
        self,
        *,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
        on_metrics: Callable[[FlowSnapshot], Any] | None = None,
        metrics_every: float = 1.0,
        join_timeout: float = 10.0,
    ) -> Run:
        """Check the graph and start every stage's thread; returns the running ``Run``.

        Args:
          timeout: seconds for the whole run; past it the run is cancelled and raises
            ``RunTimeout``.
          cancel: an event another thread (or a signal handler) sets to cancel the run.
          on_metrics: called with a ``FlowSnapshot`` every ``metrics_every`` seconds and
            once at the end, from the supervising thread; an exception there fails the run.
          join_timeout: seconds to wait, once cancelled, for stages to stop.

        Raises:
          BuildError: a graph check failed (no thread was started).
        """
        self.check()
        return Run(
            self,
            timeout=timeout,
            cancel=cancel,
            on_metrics=on_metrics,
            metrics_every=metrics_every,
            join_timeout=join_timeout,
        )

    def run(self, **options: Any) -> FlowSnapshot:
        """``start(**options).wait()``: run to the end; returns the final counters.

        Raises:
          BuildError: before anything runs, as ``start``.
          StageFailed: a stage raised or timed out (the original is ``__cause__``).
          Cancelled: cancelled from outside (``RunTimeout`` past ``timeout``).
        """
        return self.start(**options).wait()

    # ------------------------------------------------------------------ internals

    def _edge_keys(self) -> list[tuple[str, str, str, str]]:
        return [(e.src, e.src_port, e.dst, e.dst_port) for e in self._edges]

    def _endpoint(self, ref: Stage | str, kind: str) -> tuple[Stage, str]:
        port = None
        if isinstance(ref, Stage):
            stage = self.add(ref)
        elif isinstance(ref, str):
            name, _, port = ref.partition(".")
            port = port or None
            if name not in self._stages:
                raise BuildError(
                    f"pipeline {self.name!r} has no stage {name!r}; it has {list(self._stages)}"
                )
            stage = self._stages[name]
        else:
            raise BuildError(f"endpoint {ref!r}: expected a Stage, 'stage' or 'stage.port'")
        ports = stage.outputs if kind == "output" else stage.inputs
        if port is None:
            required = [name for name, spec in ports.items() if spec.required]
            if len(ports) != 1 and len(required) != 1:
                raise BuildError(
                    f"stage {stage.name!r} has {len(ports)} {kind} ports {list(ports)}; "
                    f"name one as '{stage.name}.<port>'"
                )
            port = next(iter(ports)) if len(ports) == 1 else required[0]
        if port not in ports:
            raise BuildError(
                f"stage {stage.name!r} has no {kind} port {port!r}; its {kind}s are {list(ports)}"
            )
        return stage, port

    def _check_cycles(self) -> None:
        forward: dict[str, list[str]] = {name: [] for name in self._stages}
        for e in self._edges:
            if not e.feedback:
                forward[e.src].append(e.dst)
        cycle = _find_cycle(forward)
        if cycle:
            path = " -> ".join(cycle)
            raise BuildError(
                f"pipeline {self.name!r} has a cycle {path} with no feedback edge; "
                "connect the edge that goes back upstream with feedback=True"
            )
        for e in self._edges:
            if e.feedback and not _reaches(forward, e.dst, e.src):
                raise BuildError(
                    f"feedback edge {e.name} closes no cycle: {e.dst!r} does not lead back to "
                    f"{e.src!r}; connect it without feedback=True"
                )

    def cyclic_groups(self) -> list[tuple[frozenset[str], tuple[EdgeSpec, ...]]]:
        """Each set of stages joined into a cycle, with the feedback edges inside it."""
        graph: dict[str, list[str]] = {name: [] for name in self._stages}
        for e in self._edges:
            graph[e.src].append(e.dst)
        groups = []
        for component in _strongly_connected(graph):
            inside = tuple(
                e for e in self._edges if e.feedback and e.src in component and e.dst in component
            )
            if inside:
                groups.append((frozenset(component), inside))
        return groups


def _find_cycle(graph: Mapping[str, list[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path of names, or None."""
    color = dict.fromkeys(graph, 0)  # 0 new, 1 on the stack, 2 finished
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if color[nxt] == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if color[nxt] == 0 and (found := visit(nxt)):
                return found
        stack.pop()
        color[node] = 2
        return None

    for node in graph:
        if color[node] == 0 and (found := visit(node)):
            return found
    return None


def _reaches(graph: Mapping[str, list[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        for nxt in graph[node]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def _strongly_connected(graph: Mapping[str, list[str]]) -> list[set[str]]:
    """Components with more than one stage (Kosaraju, iterative enough for small graphs)."""
    order: list[str] = []
    seen: set[str] = set()
    for root in graph:
        if root in seen:
            continue
        stack = [(root, iter(graph[root]))]
        seen.add(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in seen:
                seen.add(child)
                stack.append((child, iter(graph[child])))
    reverse: dict[str, list[str]] = {n: [] for n in graph}
    for node, children in graph.items():
        for child in children:
            reverse[child].append(node)
    assigned: set[str] = set()
    components = []
    for node in reversed(order):
        if node in assigned:
            continue
        component, todo = set(), [node]
        assigned.add(node)
        while todo:
            cur = todo.pop()
            component.add(cur)
            for nxt in reverse[cur]:
                if nxt not in assigned:
                    assigned.add(nxt)
                    todo.append(nxt)
        if len(component) > 1:
            components.append(component)
    return components
