// A small Markdown renderer for model output. It builds DOM nodes and sets only their text,
// never HTML, so nothing a model writes can become markup or script. It knows fenced code,
// headings, lists, quotes, paragraphs, inline code, bold, italics and http(s) links; the
// rest stays text. An unclosed fence (a reply still streaming) renders as code so far.
"use strict";

const Markdown = (() => {
  const el = (tag, cls) => {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    return n;
  };

  // inline: `code`, **bold**, *italic* / _italic_, [text](http...)
  const INLINE = /(`{1,3})([^`]+)\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\b_([^_]+)_\b|\[([^\]]+)\]\(([^)\s]+)\)/g;

  function inline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      if (m[1] !== undefined) {
        const c = el("code");
        c.textContent = m[2];
        parent.append(c);
      } else if (m[3] !== undefined) {
        const b = el("strong");
        inline(b, m[3]);
        parent.append(b);
      } else if (m[4] !== undefined || m[5] !== undefined) {
        const i = el("em");
        inline(i, m[4] !== undefined ? m[4] : m[5]);
        parent.append(i);
      } else {
        const url = m[7];
        if (/^https?:\/\//i.test(url)) {
          const a = el("a");
          a.href = url;
          a.rel = "noopener noreferrer nofollow";
          a.target = "_blank";
          a.textContent = m[6];
          parent.append(a);
        } else {
          parent.append(m[0]);
        }
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  function lines(parent, rows) {
    rows.forEach((row, i) => {
      if (i) parent.append(el("br"));
      inline(parent, row);
    });
  }

  function render(text) {
    const root = document.createDocumentFragment();
    const rows = text.split("\n");
    let i = 0;
    while (i < rows.length) {
      const row = rows[i];
      const fence = row.match(/^\s*(```+|~~~+)\s*([\w+#.-]*)/);
      if (fence) {
        const close = fence[1];
        const body = [];
        i++;
        while (i < rows.length && !rows[i].trim().startsWith(close)) body.push(rows[i++]);
        i++;  // the closing fence (or the end of a reply still streaming)
        const pre = el("pre");
        const code = el("code");
        if (fence[2]) code.dataset.lang = fence[2];
        code.textContent = body.join("\n");
        pre.append(code);
        root.append(pre);
        continue;
      }
      const heading = row.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        const h = el("h" + Math.min(6, heading[1].length + 2));
        inline(h, heading[2]);
        root.append(h);
        i++;
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+/;
      if (item.test(row)) {
        const ordered = /^\s*\d/.test(row);
        const list = el(ordered ? "ol" : "ul");
        while (i < rows.length && item.test(rows[i])) {
          const li = el("li");
          inline(li, rows[i].replace(item, ""));
          list.append(li);
          i++;
        }
        root.append(list);
        continue;
      }
      if (/^\s*>/.test(row)) {
        const quote = el("blockquote");
        const body = [];
        while (i < rows.length && /^\s*>/.test(rows[i])) body.push(rows[i++].replace(/^\s*>\s?/, ""));
        lines(quote, body);
        root.append(quote);
        continue;
      }
      if (!row.trim()) {
        i++;
        continue;
      }
      const p = el("p");
      const body = [];
      while (i < rows.length && rows[i].trim() && !/^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(rows[i])) {
        body.push(rows[i++]);
      }
      if (!body.length) body.push(rows[i++]);
      lines(p, body);
      root.append(p);
    }
    return root;
  }

  return { render };
})();
