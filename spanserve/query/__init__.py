"""Span queries: spnl-compatible expression trees of LLM calls, and their optimizer."""
from .ir import (Assistant, Chat, Cross, Document, Fragment, Generate, Message, Node, Par, Plus,
                 Repeat, Retrieve, Seq, System, User, assistant, chat, cross, document, fragment, g,
                 par, plus, repeat, retrieve, seq, system, user)
from .optimize import OptimizeError, optimize
from .reach import conversation_of, reachable_messages
from .retrieve import BM25Retriever, Retriever
from .wire import QueryError, dumps, parse, to_obj

__all__ = [
    "Assistant", "BM25Retriever", "Chat", "Cross", "Document", "Fragment", "Generate", "Message",
    "Node", "OptimizeError", "Par", "Plus", "QueryError", "Repeat", "Retrieve", "Retriever", "Seq",
    "System", "User", "assistant", "chat", "conversation_of", "cross", "document", "dumps",
    "fragment", "g", "optimize", "par", "parse", "plus", "reachable_messages", "repeat",
    "retrieve", "seq", "system", "to_obj", "user",
]
