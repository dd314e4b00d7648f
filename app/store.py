"""Chat history in SQLite, under platformdirs' user_data_dir("nanoqwen").

Invariants:
- The schema version is `PRAGMA user_version`; `MIGRATIONS[i]` takes a database from version
  i to i+1, each in one transaction, so a crash mid-upgrade leaves the old version intact.
  A database newer than this code is refused with a message instead of being guessed at.
- A reply is a row that exists from its first streamed batch on and is rewritten on every
  batch (`update_message`) with `finish` NULL until the reply ends. Every write commits, and
  the database is in WAL mode with synchronous=NORMAL: a commit survives the process being
  killed (SIGKILL), which is what "killing the app loses nothing shown" needs; only an OS
  crash may lose the last commits, an acceptable trade for ~0.1 ms per batch.
- The store is used from one thread (the UI's); SQLite connections are not shared.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs


class StoreError(Exception):
    """The history database cannot be used; the message names the file and the reason."""


MIGRATIONS: list[str] = [
    # 0 -> 1: chats and their messages, in order (seq) within a chat. AUTOINCREMENT: an id is
    # never reused, so a deleted (regenerated) reply and its successor are told apart.
    """
    CREATE TABLE chats (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        model TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL,
        created REAL NOT NULL
    );
    CREATE INDEX messages_by_chat ON messages(chat_id, seq);
    """,
    # 1 -> 2: how a reply ended (NULL while it streams, so an interrupted reply is visible as
    # such after a crash) and the engine's figures for it (JSON).
    """
    ALTER TABLE messages ADD COLUMN finish TEXT;
    ALTER TABLE messages ADD COLUMN stats TEXT;
    CREATE INDEX chats_by_updated ON chats(updated);
    """,
    # 2 -> 3: each chat's own system prompt (NULL: a chat from before, which used the
    # settings' prompt of the day; it keeps following the settings until one is set).
    """
    ALTER TABLE chats ADD COLUMN system_prompt TEXT;
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass
class StoredMessage:
    id: int
    role: str
    content: str
    finish: str | None  # None: the reply never finished (still streaming, or the app died)
    stats: dict | None


@dataclass
class ChatSummary:
    id: int
    title: str
    model: str
    updated: float
    n_messages: int
    system_prompt: str | None = None


def _like(text: str) -> str:
    """`text` as a LIKE pattern matching it anywhere, its own % _ and \\ taken literally."""
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def default_db_path() -> Path:
    # platformdirs honours XDG_DATA_HOME on Linux, which is how tests redirect it.
    return Path(platformdirs.user_data_dir("nanoqwen")) / "history.sqlite3"


class ChatStore:
    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as e:
            raise StoreError(f"history database {self.path}: {e}") from e

    # --- schema ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self) -> None:
        v = self.version
        if v > SCHEMA_VERSION:
            raise StoreError(
                f"history database {self.path} has schema version {v}, newer than this "
                f"nanoqwen understands ({SCHEMA_VERSION}); upgrade nanoqwen or move the file")
        for target in range(v + 1, SCHEMA_VERSION + 1):
            # executescript would COMMIT implicitly; run statements one by one inside our
            # own transaction so the version bump and the DDL land together.
            self.db.execute("BEGIN")
            try:
                for stmt in MIGRATIONS[target - 1].split(";"):
                    if stmt.strip():
                        self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version = {target}")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self.db.close()

    # --- chats ----------------------------------------------------------------------
    def new_chat(self, title: str, model: str = "", system_prompt: str | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO chats (title, model, created, updated, system_prompt) "
            "VALUES (?, ?, ?, ?, ?)", (title, model, now, now, system_prompt))
        return int(cur.lastrowid)

    def set_title(self, chat_id: int, title: str) -> None:
        self.db.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id))

    def set_system_prompt(self, chat_id: int, system_prompt: str) -> None:
        self.db.execute("UPDATE chats SET system_prompt = ? WHERE id = ?",
                        (system_prompt, chat_id))

    def chat(self, chat_id: int) -> ChatSummary | None:
        """One chat's summary (None: there is no such chat, e.g. it was deleted)."""
        row = self.db.execute(
            """SELECT c.id, c.title, c.model, c.updated,
                      (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id), c.system_prompt
               FROM chats c WHERE c.id = ?""", (chat_id,)).fetchone()
        return ChatSummary(*row) if row else None

    def chat_title(self, chat_id: int) -> str:
        row = self.db.execute("SELECT title FROM chats WHERE id = ?", (chat_id,)).fetchone()
        if row is None:
            raise StoreError(f"no chat with id {chat_id}")
        return row[0]

    def list_chats(self, limit: int = 200, search: str = "") -> list[ChatSummary]:
        """Newest first, at most `limit`; with `search`, only the chats whose title or any
        message contains it (case-insensitive for ASCII, as SQLite's LIKE is)."""
        where, args = self._search(search)
        rows = self.db.execute(
            f"""SELECT c.id, c.title, c.model, c.updated,
                       (SELECT COUNT(*) FROM messages m WHERE m.chat_id = c.id), c.system_prompt
                FROM chats c {where} ORDER BY c.updated DESC, c.id DESC LIMIT ?""",
            (*args, limit))
        return [ChatSummary(*r) for r in rows]

    def count_chats(self, search: str = "") -> int:
        where, args = self._search(search)
        return self.db.execute(f"SELECT COUNT(*) FROM chats c {where}", args).fetchone()[0]

    @staticmethod
    def _search(search: str) -> tuple[str, tuple]:
        if not search.strip():
            return "", ()
        pat = _like(search.strip())
        return ("""WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages m
                   WHERE m.chat_id = c.id AND m.content LIKE ? ESCAPE '\\')""", (pat, pat))

    def latest_chat(self) -> int | None:
        chats = self.list_chats(limit=1)
        return chats[0].id if chats else None

    def delete_chat(self, chat_id: int) -> None:
        self.db.execute("DELETE FROM chats WHERE id = ?", (chat_id,))

    # --- messages -------------------------------------------------------------------
    def add_message(self, chat_id: int, role: str, content: str,
                    finish: str | None = None) -> int:
        now = time.time()
        self.db.execute("BEGIN")
        try:
            seq = self.db.execute(
                "SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE chat_id = ?",
                (chat_id,)).fetchone()[0]
            cur = self.db.execute(
                "INSERT INTO messages (chat_id, seq, role, content, created, finish) "
                "VALUES (?, ?, ?, ?, ?, ?)", (chat_id, seq, role, content, now, finish))
            self.db.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return int(cur.lastrowid)

    def update_message(self, message_id: int, content: str, finish: str | None = None,
                       stats: dict | None = None) -> None:
        """Rewrite a streaming reply; called on every batch, so it is one autocommit UPDATE."""
        self.db.execute(
            "UPDATE messages SET content = ?, finish = COALESCE(?, finish), "
            "stats = COALESCE(?, stats) WHERE id = ?",
            (content, finish, json.dumps(stats) if stats is not None else None, message_id))

    def delete_message(self, message_id: int) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self.db.execute(
            "SELECT id, role, content, finish, stats FROM messages WHERE chat_id = ? "
            "ORDER BY seq", (chat_id,))
        return [StoredMessage(i, r, c, f, json.loads(s) if s else None)
                for i, r, c, f, s in rows]

    # --- export ---------------------------------------------------------------------
    def export_markdown(self, chat_id: int) -> str:
        """The chat as a Markdown document: its model and system prompt, a heading per
        turn, replies verbatim, and under each reply how it was made (reply_note)."""
        chat = self.chat(chat_id)
        if chat is None:
            raise StoreError(f"no chat with id {chat_id}")
        out = [f"# {chat.title}", ""]
        about = [f"model: {chat.model}" if chat.model else None,
                 "exported " + time.strftime("%Y-%m-%d %H:%M")]
        out += ["*" + " · ".join(a for a in about if a) + "*", ""]
        if chat.system_prompt:
            out += ["**System prompt:**", "", chat.system_prompt.rstrip(), ""]
        for m in self.messages(chat_id):
            heading = {"user": "You", "assistant": "Assistant", "system": "System"}[m.role]
            out += [f"## {heading}", "", m.content.rstrip(), ""]
            if m.role == "assistant":
                if m.finish in (None, "cancelled"):
                    out += ["*(reply interrupted)*" if m.finish is None else "*(stopped)*", ""]
                note = reply_note(m.stats)
                if note:
                    out += [f"<sub>{note}</sub>", ""]
        return "\n".join(out)


def _num(v, unit: str, digits: int = 1) -> str | None:
    return f"{v:.{digits}f} {unit}" if isinstance(v, (int, float)) else None


def reply_note(stats: dict | None) -> str:
    """One line on how a reply was made, from its stored figures: the model and backend, the
    sampler, tokens, the engine's and the screen's rates, both TTFTs ("" if none stored)."""
    if not stats:
        return ""
    s = stats
    parts = []
    if s.get("model"):
        where = s.get("backend") or ""
        if s.get("device"):
            where += f" ({s['device']})"
        parts.append(" · ".join(p for p in (s["model"], where.strip(), s.get("mode")) if p))
    elif s.get("mode"):
        parts.append(s["mode"])
    sp = s.get("sampler")
    if isinstance(sp, dict):
        if sp.get("temperature", 1) <= 0:
            parts.append("greedy")
        else:
            parts.append(f"temperature {sp.get('temperature')}, top-k {sp.get('top_k')}, "
                         f"top-p {sp.get('top_p')}, min-p {sp.get('min_p')}, repetition "
                         f"penalty {sp.get('repeat_penalty')} (last {sp.get('repeat_last_n')}),"
                         f" seed {sp.get('seed')}")
    if isinstance(s.get("n_generated"), int):
        parts.append(f"{s['n_generated']} tokens")
    rates = [r for r in (_num(s.get("tokens_per_s"), "tok/s engine"),
                         _num(s.get("screen_tokens_per_s"), "tok/s on screen")) if r]
    if rates:
        parts.append(", ".join(rates))
    ttft = [t for t in (_num(s.get("ttft_ms"), "ms engine"),
                        _num(s.get("seen_ttft_ms"), "ms seen")) if t]
    if ttft:
        parts.append("TTFT " + ", ".join(ttft))
    if s.get("error"):
        parts.append(f"failed: {str(s['error']).splitlines()[0]}")
    return " · ".join(parts)
