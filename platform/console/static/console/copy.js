// Copy buttons (`<button data-copy="ID" hidden>`): shown once this script runs; a click copies the text of the
// element #ID and says so in #copy-status. No inline script: the console's Content-Security-Policy allows none.
(() => {
  const status = (text) => {
    const live = document.getElementById("copy-status");
    if (live) live.textContent = text;
  };
  const selectText = (element) => {
    const range = document.createRange();
    range.selectNodeContents(element);
    const selection = window.getSelection();
    selection.removeAllRanges();
    selection.addRange(range);
  };
  for (const button of document.querySelectorAll("button[data-copy]")) {
    button.hidden = false;
    button.addEventListener("click", () => {
      const source = document.getElementById(button.dataset.copy);
      if (!source) return;
      const text = source.textContent.trim();
      const fallback = () => {
        selectText(source);
        status(document.execCommand && document.execCommand("copy") ? "Copied." : "Selected: press Ctrl+C to copy.");
      };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(() => status("Copied."), fallback);
      } else {
        fallback();
      }
    });
  }
})();
