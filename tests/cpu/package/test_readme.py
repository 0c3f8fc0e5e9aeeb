"""The README's option table is the one generated from supermem/config.py."""

from pathlib import Path

from supermem.config import markdown_table


def test_readme_options_table_is_generated_from_the_options_table():
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    section = readme.split("<!-- options:begin -->")[1].split("<!-- options:end -->")[0]
    assert section.strip() == markdown_table().strip()
