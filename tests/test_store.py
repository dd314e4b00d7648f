"""The chat history store: schema versions and migrations, streaming updates, export."""

from __future__ import annotations

import sqlite3

import pytest

from nanoqwen.app.store import MIGRATIONS, SCHEMA_VERSION, ChatStore, StoreError, default_db_path


def test_new_database_gets_the_current_schema(tmp_path):
    s = ChatStore(tmp_path / "h.sqlite3")
    assert s.version == SCHEMA_VERSION == len(MIGRATIONS)
    cols = {r[1] for r in s.db.execute("PRAGMA table_info(messages)")}
    assert {"chat_id", "seq", "role", "content", "finish", "stats"} <= cols
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_v1_database_is_migrated_keeping_its_chats(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("INSERT INTO chats (id, title, model, created, updated) VALUES (1, 't', 'm', 1, 1)")
    db.execute("INSERT INTO messages (chat_id, seq, role, content, created) "
               "VALUES (1, 0, 'user', 'hi', 1), (1, 1, 'assistant', 'hello', 1)")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()

    s = ChatStore(path)
    assert s.version == SCHEMA_VERSION
    msgs = s.messages(1)
    assert [(m.role, m.content) for m in msgs] == [("user", "hi"), ("assistant", "hello")]
    assert msgs[1].finish is None and msgs[1].stats is None  # new columns, old rows


def test_newer_database_is_refused_with_a_message(tmp_path):
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match=r"schema version \d+, newer than"):
        ChatStore(path)


def test_file_that_is_not_a_database_is_an_error_naming_it(tmp_path):
    path = tmp_path / "junk.sqlite3"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="junk.sqlite3"):
        ChatStore(path)


def test_streaming_reply_is_rewritten_and_finished(tmp_path):
    s = ChatStore(tmp_path / "h.sqlite3")
    chat = s.new_chat("first", "tiny")
    s.add_message(chat, "user", "question")
    mid = s.add_message(chat, "assistant", "")
    for part in ("Hel", "Hello", "Hello, world"):
        s.update_message(mid, part)
        # another connection sees every batch: it is committed, not pending in a transaction
        other = sqlite3.connect(s.path)
        assert other.execute("SELECT content, finish FROM messages WHERE id = ?",
                             (mid,)).fetchone() == (part, None)
        other.close()
    s.update_message(mid, "Hello, world!", finish="stop", stats={"ttft_ms": 1.5})
    m = s.messages(chat)[-1]
    assert (m.content, m.finish, m.stats) == ("Hello, world!", "stop", {"ttft_ms": 1.5})


def test_list_chats_newest_first_and_delete(tmp_path):
    s = ChatStore(tmp_path / "h.sqlite3")
    a = s.new_chat("a")
    b = s.new_chat("b")
    s.add_message(a, "user", "later message makes a the newest")
    assert [c.id for c in s.list_chats()] == [a, b]
    assert s.list_chats()[0].n_messages == 1
    assert s.latest_chat() == a
    s.delete_chat(a)
    assert [c.id for c in s.list_chats()] == [b]
    assert s.messages(a) == []


def test_export_markdown(tmp_path):
    s = ChatStore(tmp_path / "h.sqlite3")
    chat = s.new_chat("Adding numbers")
    s.add_message(chat, "user", "add two numbers")
    s.add_message(chat, "assistant", "```python\ndef add(a, b):\n    return a + b\n```",
                  finish="stop")
    s.add_message(chat, "user", "again")
    s.add_message(chat, "assistant", "partial", finish=None)
    md = s.export_markdown(chat)
    assert md.startswith("# Adding numbers\n")
    assert "## You\n\nadd two numbers" in md
    assert "```python\ndef add(a, b):\n    return a + b\n```" in md
    assert "partial\n\n*(reply interrupted)*" in md


def test_default_path_follows_xdg_data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "nanoqwen" / "history.sqlite3"
