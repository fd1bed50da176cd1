"""Route keys of an API request, computed at the gateway the way a replica's cache will key it:
the same tokenizer, the same layout resolution, the same seeds (see routing.layout_keys).

A span query's layouts exist only once its inner generations ran, so it is keyed by the plus
children made of messages alone (documents, fixed context), rendered as its planner renders
them. Anything the gateway cannot read (malformed JSON, unknown routes) gets no keys: it goes
to the least loaded replica, which answers it (errors included) exactly as a single server would.
"""
from __future__ import annotations

import json
import urllib.parse
from typing import Any

from spanserve.cache.claim import Piece
from spanserve.cluster.routing import RouteKey, layout_keys, plus_key, prefix_key
from spanserve.engine.layout import Segment, resolve
from spanserve.reuse.policies import resolve_policy
from spanserve.toolcall.spec import parse_tools


class KeyMaker:
    def __init__(self, tokenizer: Any, block_size: int, default_policy: str = "none",
                 chat_template: str | None = None):
        """chat_template: the one the replicas render chats with (their ChatSetup's), if not the
        tokenizer's own; the tokenizer is the key maker's to change."""
        if tokenizer is not None and chat_template is not None:
            tokenizer.chat_template = chat_template
        self.tok = tokenizer
        self.block_size = block_size
        self.default_policy = default_policy

    def keys(self, path: str, body: bytes, query: str = "") -> list[RouteKey]:
        try:
            if path == "/v1/query/execute":
                salt = urllib.parse.parse_qs(query).get("cache_salt", [""])[0]
                return self._query(body, salt)
            req = json.loads(body) if body else None
            if not isinstance(req, dict):
                return []
            if path == "/v1/completions":
                return self._completion(req)
            if path == "/v1/chat/completions":
                return self._chat(req)
            if path == "/v1/segments":
                segs = [Segment(token_ids=self._ids(s), kind="plus") for s in req.get("segments") or []]
                return self._layout(segs + [Segment(token_ids=[0])], req)
        except Exception:  # noqa: BLE001 - routing never fails a request: the replica answers it
            pass
        return []

    def _ids(self, seg: dict) -> list[int]:
        if seg.get("text") is not None:
            return self._encode(str(seg["text"]))
        return [int(t) for t in seg.get("token_ids") or []]

    def _encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise ValueError("no tokenizer")
        return list(self.tok.encode(text, add_special_tokens=False))

    def _layout(self, segs: list[Segment], req: dict) -> list[RouteKey]:
        policy = resolve_policy(req.get("policy"), resolve_policy(self.default_policy))
        pieces = resolve(segs, self._encode, policy.name)
        return layout_keys(pieces, req.get("cache_salt") or "", self.block_size)

    def _plain(self, ids: list[int], req: dict) -> list[RouteKey]:
        return [prefix_key(ids, req.get("cache_salt") or "", self.block_size)] if ids else []

    def _completion(self, req: dict) -> list[RouteKey]:
        if req.get("segments"):
            segs = [Segment(token_ids=self._ids(s), kind=s.get("kind", "cross"), anchor=s.get("anchor", "none"))
                    for s in req["segments"]]
            return self._layout(segs, req)
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt names it
        if isinstance(prompt, str):
            return self._plain(self._encode(prompt), req)
        return self._plain([int(t) for t in prompt or []], req)

    def _chat(self, req: dict) -> list[RouteKey]:
        from spanserve.query.plan import Planner
        from spanserve.server.protocol import ChatMessage
        from spanserve.server.span import chat_query, is_span_chat

        if self.tok is None or not getattr(self.tok, "chat_template", None):
            return []
        messages = [ChatMessage.model_validate(m) for m in req.get("messages") or []]
        gen = req.get("add_generation_prompt", True)
        # the tools as the replica hands them to the template: they are part of the prompt
        tools = [t.as_template_dict() for t in parse_tools(req["tools"])] if req.get("tools") else None
        if is_span_chat(messages):
            segs = Planner(self.tok, tools=tools).layout(chat_query(messages), gen)
            return self._layout(list(segs), req)
        text = self.tok.apply_chat_template([m.as_template_dict() for m in messages], tools=tools, tokenize=False,
                                            add_generation_prompt=gen)
        return self._plain(self._encode(text), req)

    def _query(self, body: bytes, salt: str) -> list[RouteKey]:
        from spanserve.query.ir import Generate, Group, Message, Par, Plus, Repeat
        from spanserve.query.plan import Planner
        from spanserve.query.wire import parse

        planner = Planner(self.tok)
        found: dict[int, RouteKey] = {}

        def messages(node: Any) -> list[Message] | None:
            if isinstance(node, Message):
                return [node]
            if isinstance(node, Group) and not isinstance(node, (Plus, Par)):
                parts = [messages(c) for c in node.children]
                return None if any(p is None for p in parts) else [m for p in parts for m in p or []]
            return None

        def walk(node: Any) -> None:
            if isinstance(node, (Plus, Par)):
                for child in node.children:
                    parts = messages(child)
                    if parts:
                        ids = [t for m in parts for t in self._encode(planner.turn(m))]
                        k = plus_key(Piece("plus", tuple(ids), 0), (), salt, self.block_size)
                        found[k.key] = k
            if isinstance(node, Group):
                for child in node.children:
                    walk(child)
            elif isinstance(node, Generate):
                walk(node.input)
            elif isinstance(node, Repeat):
                walk(node.query)

        walk(parse(body))
        return list(found.values())
