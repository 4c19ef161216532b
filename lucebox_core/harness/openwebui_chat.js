// Drive Open WebUI in headless Chromium: load the page, send one chat message, wait for the answer, keep a
// screenshot. Usage: node openwebui_chat.js URL MESSAGE SCREENSHOT_PREFIX (prints one JSON line).
// playwright-core is resolved from NODE_PATH (the harness's npm folder); Chromium is the system's.
const { chromium } = require("playwright-core");

async function main() {
  const [url, message, shots] = process.argv.slice(2);
  const fs = require("fs");
  const os = require("os");
  const path = require("path");
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "lucebox-chromium-"));
  const browser = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    headless: true,
    viewport: { width: 1280, height: 860 },
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
  });
  const result = { loaded: false, sent: false, answer: "", screenshots: [] };
  const page = browser.pages()[0] || await browser.newPage();
  try {
    await page.goto(url, { waitUntil: "domcontentloaded", timeout: 120000 });
    const input = page.locator("#chat-input");
    await input.waitFor({ state: "visible", timeout: 120000 });
    result.loaded = true;
    // A fresh install opens with a release-notes dialog over the page: close it.
    const dismiss = page.getByText("Okay, Let's Go!");
    if (await dismiss.count()) await dismiss.first().click();
    await page.keyboard.press("Escape");
    await page.locator("div[role='dialog']").waitFor({ state: "detached", timeout: 10000 }).catch(() => {});
    await page.screenshot({ path: `${shots}-loaded.png` });
    result.screenshots.push(`${shots}-loaded.png`);
    await input.click();
    await page.keyboard.type(message);
    await page.keyboard.press("Enter");
    result.sent = true;
    // The answer is the last assistant message's text once the response is done (no stop button left).
    const answer = page.locator("#response-content-container").last();
    await answer.waitFor({ state: "visible", timeout: 180000 });
    const deadline = Date.now() + 180000;
    let text = "";
    while (Date.now() < deadline) {
      text = (await answer.innerText()).trim();
      const generating = await page.locator("button[aria-label='Stop'], #stop-response-button").count();
      if (text && !generating) break;
      await page.waitForTimeout(500);
    }
    result.answer = text;
  } catch (error) {
    result.error = String(error).slice(0, 800);
  } finally {
    try {
      await page.screenshot({ path: `${shots}-chat.png`, fullPage: true });
      result.screenshots.push(`${shots}-chat.png`);
    } catch (error) {}
    await browser.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
  console.log(JSON.stringify(result));
}

main().catch((error) => { console.log(JSON.stringify({ error: String(error) })); process.exit(1); });
