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
    assert "<sub>" not in md        # no figures stored, none shown
    assert "## You\n\nadd two numbers" in md
    assert "```python\ndef add(a, b):\n    return a + b\n```" in md
    assert "partial\n\n*(reply interrupted)*" in md


def test_default_path_follows_xdg_data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_db_path() == tmp_path / "data" / "nanoqwen" / "history.sqlite3"


def test_v2_database_is_migrated_and_its_chats_follow_the_settings_prompt(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    for script in MIGRATIONS[:2]:
        for stmt in script.split(";"):
            if stmt.strip():
                db.execute(stmt)
    db.execute("INSERT INTO chats (id, title, model, created, updated) VALUES (1, 't', 'm', 1, 1)")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    s = ChatStore(path)
    assert s.version == SCHEMA_VERSION
    assert s.chat(1).system_prompt is None          # NULL: from before per-chat prompts
    s.set_system_prompt(1, "Be terse.")
    assert s.chat(1).system_prompt == "Be terse."
    assert s.chat(2) is None


def test_search_matches_titles_and_messages_literally(tmp_path):
    s = ChatStore(tmp_path / "h.sqlite3")
    a = s.new_chat("Fix 100% CPU", "m", "sys")
    s.add_message(a, "user", "my_var is slow")
    b = s.new_chat("other")
    s.add_message(b, "assistant", "Use a DICT here")
    s.new_chat("nothing")

    def ids(q):
        return [c.id for c in s.list_chats(search=q)]
    assert ids("100%") == [a] and ids("my_var") == [a]
    assert ids("my%var") == [] and ids("1_0") == []      # % and _ are not wildcards
    assert ids("dict") == [b]                            # any message, any case (ASCII)
    assert ids("  ") == ids("") and len(ids("")) == 3
    assert s.count_chats("o") == 3 and s.count_chats("slow") == 1
    assert [c.id for c in s.list_chats(limit=1)] == [s.latest_chat()]


def test_reply_note_says_how_a_reply_was_made():
    from nanoqwen.app.store import reply_note

    stats = {"model": "M", "backend": "cuda", "device": "NVIDIA H200", "mode": "graph",
             "sampler": {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                         "repeat_penalty": 1.1, "repeat_last_n": 64, "seed": 7},
             "n_generated": 12, "tokens_per_s": 512.34, "screen_tokens_per_s": 500.0,
             "ttft_ms": 8.44, "seen_ttft_ms": 38.6}
    assert reply_note(stats) == (
        "M · cuda (NVIDIA H200) · graph · temperature 0.7, top-k 40, top-p 0.95, min-p 0.05, "
        "repetition penalty 1.1 (last 64), seed 7 · 12 tokens · 512.3 tok/s engine, "
        "500.0 tok/s on screen · TTFT 8.4 ms engine, 38.6 ms seen")
    assert reply_note({"sampler": {"temperature": 0.0}, "error": "out of memory\nmore"}) == \
        "greedy · failed: out of memory"
    assert reply_note(None) == "" and reply_note({}) == ""
