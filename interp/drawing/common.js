
  const decodeCodes = b64 => { const raw = atob(b64), A = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) A[i] = raw.charCodeAt(i); return A; };
  const viridis = t => {  // 5-stop approximation of matplotlib's viridis
    const s = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
    t = Math.max(0, Math.min(1, t)) * 4; const i = Math.min(3, Math.floor(t)), f = t - i;
    return "rgb(" + s[i].map((c, j) => Math.round(c + f * (s[i + 1][j] - c))).join(",") + ")";
  };
  const hex = (c, w) => c.charCodeAt(0).toString(16).toUpperCase().padStart(w, "0");
  // a token as visible text: newline, tab and space as symbols, other control characters as \xNN,
  // bidirectional and zero-width marks as <U+XXXX>, so nothing is invisible or reorders the line
  const tokenText = t => String(t).replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u00b7")
    .replace(/[\u0000-\u001f\u007f-\u009f]/g, c => "\\x" + hex(c, 2))
    .replace(/[\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]/g, c => "<U+" + hex(c, 4) + ">");
  const rgbOf = css => {  // any CSS colour as [r, g, b], through a canvas's own parser
    const c = document.createElement("canvas").getContext("2d"); c.fillStyle = "#000"; c.fillStyle = css;
    const m = /^#([0-9a-f]{2})([0-9a-f]{2})([0-9a-f]{2})/i.exec(c.fillStyle);
    return m ? [1, 2, 3].map(i => parseInt(m[i], 16)) : (c.fillStyle.match(/[\d.]+/g) || [0, 0, 0]).slice(0, 3).map(Number);
  };
  function tokenSpans(container, tokens, onHover) {  // one span per token; onHover(i) and onHover(null)
    return tokens.map((t, i) => {
      const s = document.createElement("span");
      s.className = "tok"; s.dataset.i = i; s.textContent = tokenText(t);
      s.addEventListener("mouseenter", () => onHover(i));
      s.addEventListener("mouseleave", () => onHover(null));
      container.appendChild(s); return s;
    });
  }
  // colour the tokens for a hovered one: what it attends to (w(hover, j), j <= hover) in `to`, which later
  // tokens attend to it (w(j, hover), j > hover) in `from`, scaled to the strongest weight shown;
  // data-weight keeps the raw value
  function paintTokens(spans, hover, w, to = [31, 119, 180], from = [255, 127, 14]) {
    let top = 1e-9;
    if (hover !== null) spans.forEach((s, j) => { top = Math.max(top, j <= hover ? w(hover, j) : w(j, hover)); });
    spans.forEach((s, j) => {
      s.classList.toggle("hover", j === hover);
      if (hover === null) { s.style.background = ""; s.dataset.weight = ""; s.title = ""; return; }
      const x = j <= hover ? w(hover, j) : w(j, hover), c = j <= hover ? to : from;
      s.dataset.weight = x.toFixed(3);
      s.style.background = "rgba(" + c.join(",") + "," + (x / top).toFixed(3) + ")";
      s.title = (j <= hover ? "attention from the hovered token: " : "attention to the hovered token: ") + x.toFixed(3);
    });
  }
  // draw an n x n pattern w(q, k) into `canvas` (queries down, keys across), `size` pixels a side: each
  // pixel the largest weight of its block (a thin diagonal stays visible at any size), white to `rgb`
  function drawPattern(canvas, n, w, size, rgb = [0, 0, 255], mask = false) {
    const px = Math.min(n, size), img = canvas.getContext("2d").createImageData(px, px), bin = n / px;
    for (let y = 0; y < px; y++) for (let x = 0; x < px; x++) {
      let v = 0;
      for (let q = Math.floor(y * bin); q < Math.floor((y + 1) * bin); q++)
        for (let k = Math.floor(x * bin); k < Math.floor((x + 1) * bin); k++) if (!(mask && k > q)) v = Math.max(v, w(q, k));
      v = Math.max(0, Math.min(1, v)); const o = (y * px + x) * 4;
      img.data[o] = 255 - v * (255 - rgb[0]); img.data[o + 1] = 255 - v * (255 - rgb[1]);
      img.data[o + 2] = 255 - v * (255 - rgb[2]); img.data[o + 3] = 255;
    }
    canvas.width = px; canvas.height = px; canvas.getContext("2d").putImageData(img, 0, 0);
  }
  // a layers x heads grid of clickable cells coloured by score[l][h] (null: grey); returns repaint(score, sel)
  function headGrid(grid, L, H, onClick) {
    const cell = (H <= 16 && L <= 16 ? 22 : 14) + "px", cells = [];
    grid.style.gridTemplateColumns = "repeat(" + H + ", " + cell + ")"; grid.style.gridAutoRows = cell;
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
      const c = document.createElement("div"); c.dataset.layer = l; c.dataset.head = h;
      c.addEventListener("click", () => onClick(l, h)); grid.appendChild(c); cells.push(c);
    }
    return (score, label, sl, sh, name) => {
      let lo = Infinity, hi = -Infinity;
      if (score) score.forEach(r => r.forEach(x => { if (x !== null) { lo = Math.min(lo, x); hi = Math.max(hi, x); } }));
      cells.forEach(c => {
        const l = +c.dataset.layer, h = +c.dataset.head, x = score ? score[l][h] : null;
        c.style.background = x === null ? "#eee" : viridis(hi > lo ? (x - lo) / (hi - lo) : 0.5);
        c.title = (name ? name(l, h) : "L" + l + "H" + h) + (x === null ? "" : " " + label + " " + x.toFixed(3));
        c.classList.toggle("sel", l === sl && h === sh);
      });
    };
  }
