"""clusterserve.bench.quality.corpus's hand-written questions: the file parses, each question goes to its page's
document, and pages outside the corpus are left out."""

from clusterserve.bench.quality.corpus import QUESTIONS, Document, questions


def _rows() -> list[tuple[str, str]]:
    lines = [line for line in QUESTIONS.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [tuple(line.split("\t")) for line in lines]


def test_every_line_is_a_page_and_a_question():
    rows = _rows()
    assert len(rows) >= 40
    assert all(len(row) == 2 and row[0] and len(row[1].split()) >= 4 for row in rows), rows
    assert len({question for _, question in rows}) == len(rows)  # no question twice


def test_questions_go_to_their_page_and_skip_pages_not_in_the_corpus():
    pages = sorted({page for page, _ in _rows()})
    docs = [Document(pages[1], "text", 10), Document("not-a-page.1", "text", 10), Document(pages[0], "text", 10)]
    asked = questions(docs)
    expected = {page: sum(p == page for p, _ in _rows()) for page in pages[:2]}
    assert [q.document for q in asked].count(2) == expected[pages[0]]
    assert [q.document for q in asked].count(0) == expected[pages[1]]
    assert len(asked) == sum(expected.values())
    assert all(q.text in {question for _, question in _rows()} for q in asked)


def test_no_corpus_page_no_question():
    assert questions([Document("not-a-page.1", "text", 10)]) == []
