// The audit page on a phone: the filters fold away (their summary opens them) so the events come first, unless
// filters are set or refused. Without scripts they stay open, as on a laptop.
document.addEventListener("DOMContentLoaded", () => {
  const box = document.getElementById("audit-filters");
  if (box && !box.hasAttribute("data-keep-open") && window.matchMedia("(max-width: 640px)").matches) {
    box.open = false;
  }
});
