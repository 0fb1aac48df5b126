// Marks the short cells of every table (a figure, a name, a ratio) so that tables.css keeps them on one line.
document.addEventListener("DOMContentLoaded", () => {
  for (const cell of document.querySelectorAll("article.bd-article td, article.bd-article th")) {
    if (cell.textContent.trim().length <= 28) cell.classList.add("short");
  }
});
