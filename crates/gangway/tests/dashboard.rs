//! The dashboard in a real browser: headless Chromium driven over WebDriver
//! (chromedriver) against `gangway up`. Skips unless chromium-driver is
//! installed or `GANGWAY_REQUIRE_CHROMIUM` is set (CI sets it).

use base64::Engine;
use serde_json::{json, Value};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_gangway");
const TOKEN: &str = "dashboard-admin-token";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port")
}

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        // SIGTERM first: `gangway up` stops its agents and their ranks.
        let _ = Command::new("kill").arg(self.0.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A minimal WebDriver client: what this test needs and nothing else.
struct Browser {
    base: String,
    _driver: Kill,
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Browser {
    fn start() -> Option<Browser> {
        let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists());
        let Some(driver) = driver else {
            gangway_store::testing::skip_or_fail(
                "GANGWAY_REQUIRE_CHROMIUM",
                "chromedriver is missing (apt-get install chromium chromium-driver)",
            );
            return None;
        };
        let port = free_port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver");
        let driver = Kill(child);
        let base = format!("http://127.0.0.1:{port}");
        wait("chromedriver", 20, || {
            ureq::get(&format!("{base}/status")).call().ok().map(|_| ())
        });
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": { "args": ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"] }
        }}});
        let v: Value = ureq::post(&format!("{base}/session"))
            .send_json(caps)
            .expect("new session")
            .into_json()
            .expect("json");
        let session = v["value"]["sessionId"]
            .as_str()
            .expect("session id")
            .to_string();
        Some(Browser {
            base: format!("{base}/session/{session}"),
            _driver: driver,
        })
    }

    fn post(&self, path: &str, body: Value) -> Value {
        match ureq::post(&format!("{}{path}", self.base)).send_json(body) {
            Ok(r) => r.into_json::<Value>().expect("json")["value"].clone(),
            Err(ureq::Error::Status(c, r)) => panic!(
                "webdriver {path}: {c} {}",
                r.into_string().unwrap_or_default()
            ),
            Err(e) => panic!("webdriver {path}: {e}"),
        }
    }

    fn goto(&self, url: &str) {
        self.post("/url", json!({ "url": url }));
    }

    fn js(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({ "script": script, "args": [] }))
    }

    fn find(&self, css: &str) -> String {
        let v = self.post("/element", json!({ "using": "css selector", "value": css }));
        v[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("element {css}: {v}"))
            .to_string()
    }

    fn click(&self, css: &str) {
        let e = self.find(css);
        self.post(&format!("/element/{e}/click"), json!({}));
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css);
        self.post(&format!("/element/{e}/value"), json!({ "text": text }));
    }

    /// Waits until `script` returns `want`.
    fn wait_js(&self, what: &str, script: &str, want: Value) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.js(script);
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: page shows {got}, expected {want}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn screenshot(&self) -> Vec<u8> {
        let v: Value = ureq::get(&format!("{}/screenshot", self.base))
            .call()
            .expect("screenshot")
            .into_json()
            .expect("json");
        base64::engine::general_purpose::STANDARD
            .decode(v["value"].as_str().expect("png"))
            .expect("base64")
    }
}

fn wait<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn api(addr: &str, method: &str, path: &str, body: Option<Value>) -> Value {
    let r = ureq::request(method, &format!("{addr}{path}"))
        .set("Authorization", &format!("Bearer {TOKEN}"));
    let r = match body {
        Some(b) => r.send_json(b),
        None => r.call(),
    };
    r.expect("api").into_json().expect("json")
}

#[test]
fn the_dashboard_shows_the_grid_a_pending_reason_a_placement_and_cancels() {
    let Some(browser) = Browser::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let port = free_port();
    let addr = format!("http://127.0.0.1:{port}");
    let _up = Kill(
        Command::new(BIN)
            // Plain HTTP: the headless browser does not know up's throwaway CA.
            .args(["up", "--nodes", "2", "--gpus-per-node", "4", "--no-tls"])
            .args(["--disk-pressure-percent", "0"])
            .args([
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin-token",
                TOKEN,
            ])
            .arg("--data-dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("gangway up"),
    );
    wait("two nodes", 30, || {
        let v = ureq::get(&format!("{addr}/v1/nodes"))
            .set("Authorization", &format!("Bearer {TOKEN}"))
            .call()
            .ok()?
            .into_json::<Value>()
            .ok()?;
        (v.as_array()?.len() == 2).then_some(())
    });

    // Sign in with the token, then the cluster grid: 2 nodes × 4 GPUs.
    browser.goto(&format!("{addr}/"));
    browser.wait_js(
        "the sign-in form",
        "return !!document.querySelector('#token') || document.body.innerHTML.slice(0, 300)",
        json!(true),
    );
    browser.type_into("#token", TOKEN);
    browser.click("#signin");
    browser.wait_js(
        "GPU cells",
        "return document.querySelectorAll('.gpu').length",
        json!(8),
    );
    browser.wait_js(
        "totals",
        "return document.querySelector('#total-gpus').textContent",
        json!("8"),
    );

    let job = |name: &str, replicas: u32| {
        json!({ "name": name, "queue": "default", "replicas": replicas, "resources": { "gpus": 4 },
                "run": { "command": ["sleep", "600"] } })
    };
    let big = api(&addr, "POST", "/v1/jobs", Some(job("big", 2)))["id"]
        .as_u64()
        .expect("id");
    wait("big runs", 30, || {
        (api(&addr, "GET", &format!("/v1/jobs/{big}"), None)["state"] == "running").then_some(())
    });
    browser.wait_js(
        "every GPU allocated",
        "return document.querySelectorAll('.gpu.allocated').length",
        json!(8),
    );
    let small = api(&addr, "POST", "/v1/jobs", Some(job("small", 1)))["id"]
        .as_u64()
        .expect("id");

    // The jobs view: the new job is pending, with its reason.
    browser.goto(&format!("{addr}/#/jobs"));
    let row = format!("tr.job[data-job='{small}']");
    browser.wait_js(
        "pending",
        &format!("const r = document.querySelector(\"{row} .state\"); return r && r.textContent"),
        json!("pending"),
    );
    // The reason the API gives, word for word.
    let reason = wait("a reason", 20, || {
        api(&addr, "GET", &format!("/v1/jobs/{small}"), None)["reason"]
            .as_str()
            .map(str::to_string)
    });
    eprintln!("reason: {reason}");
    browser.wait_js(
        "the reason",
        &format!(
            "const r = document.querySelector(\"{row} .why\"); return !!r && r.textContent.startsWith({})",
            json!(reason)
        ),
        json!(true),
    );
    let shot = browser.screenshot();
    assert!(shot.starts_with(b"\x89PNG"), "a PNG screenshot");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-jobs.png");
    std::fs::write(&out, &shot).expect("save the screenshot");
    eprintln!("screenshot: {}", out.display());

    // The big job ends; the small one runs, on the GPUs the API says.
    api(&addr, "POST", &format!("/v1/jobs/{big}/cancel"), None);
    let placed = wait("small runs", 30, || {
        let j = api(&addr, "GET", &format!("/v1/jobs/{small}"), None);
        (j["state"] == "running").then(|| j["placement"][0].clone())
    });
    browser.goto(&format!("{addr}/#/jobs/{small}"));
    browser.wait_js(
        "running",
        "const e = document.querySelector('#job-state'); return e && e.textContent",
        json!("running"),
    );
    let gpus: Vec<String> = placed["gpus"]
        .as_array()
        .expect("gpus")
        .iter()
        .map(|g| g.to_string())
        .collect();
    browser.wait_js(
        "its node and GPUs",
        "const r = document.querySelector('tr.rank'); return r && [...r.children].slice(1).map(c => c.textContent).join(' ')",
        json!(format!("{} {}", placed["node"].as_str().unwrap_or(""), gpus.join(", "))),
    );
    let shot = browser.screenshot();
    std::fs::write(
        std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-job.png"),
        &shot,
    )
    .expect("save");

    // Cancel from the page.
    browser.click("#cancel");
    browser.wait_js(
        "cancelled",
        "const e = document.querySelector('#job-state'); return e && e.textContent",
        json!("cancelled"),
    );
    assert_eq!(
        api(&addr, "GET", &format!("/v1/jobs/{small}"), None)["state"],
        "cancelled"
    );

    // The decision log page shows a policy change: what, who, why.
    let mut p = api(&addr, "GET", "/v1/policy", None)["policy"].clone();
    p["scheduler"]["max_preemption_searches"] = 7.into();
    let reason = "fewer preemption searches per cycle";
    let v = api(
        &addr,
        "POST",
        "/v1/policy/apply",
        Some(json!({ "policy": p.to_string(), "reason": reason, "force": true })),
    );
    assert_eq!(v["version"], 2, "{v}");
    browser.goto(&format!("{addr}/#/policy"));
    browser.wait_js(
        "the decision log",
        &format!(
            "const r = document.querySelector(\"tr.policy-version[data-version='2']\"); return !!r && r.textContent.includes({}) && r.textContent.includes('scheduler.max_preemption_searches: 4 -> 7') && r.textContent.includes('apply')",
            json!(reason)
        ),
        json!(true),
    );
}
