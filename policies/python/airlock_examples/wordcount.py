"""word_count: counts the lines, words and bytes of a workspace file (as `wc` does), writes
them to an output file, and keeps a running total of the words counted in the session's
state. airlock's runner imports this module and calls word_count(session=..., source=...,
out=...): `source` is the input's path, `out` the staged path of the output, which airlock
publishes with the new state when the function returns."""


def word_count(session, source, out):
    with open(source, "rb") as f:
        data = f.read()
    lines, words, size = data.count(b"\n"), len(data.split()), len(data)
    with open(out, "w") as f:
        f.write("%d %d %d\n" % (lines, words, size))
    state = dict(session["state"])
    state["words_counted"] = state.get("words_counted", 0) + words
    return {
        "content": [
            {"type": "text", "text": "%d lines, %d words, %d bytes" % (lines, words, size)}
        ],
        "state": state,
    }
