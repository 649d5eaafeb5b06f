//! `devlend-edu-vmm SOCKET`: acts as the VMM of a lent `edu` function on a vfio-user
//! socket, for tests that run inside a guest (no QEMU 11 there): checks the config
//! space (1234:11e8) and the ID register, has the card compute 10! with its MSI, and
//! copies eight pages of "guest memory" through the card's DMA engine and back. Prints
//! a `DEVLEND-RESULT` line for each step; exits 1 when one is not as expected.

use std::os::fd::AsRawFd;
use std::path::PathBuf;

use devlend_tests::edu::{Memory, Vmm, BAR0, CONFIG, GUEST_MEM, ID, IOVA};

fn main() {
    let Some(sock) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: devlend-edu-vmm SOCKET");
        std::process::exit(2);
    };
    let mut failed = false;
    let mut check = |key: &str, got: String, want: &str| {
        println!("DEVLEND-RESULT {key}={got}");
        if got != want {
            eprintln!("devlend-edu-vmm: {key} is {got}, not {want}");
            failed = true;
        }
    };
    let mut vmm = Vmm::join(&sock);
    check(
        "edu_ids",
        format!("{:#010x}", vmm.r32(CONFIG, 0)),
        "0x11e81234",
    );
    check(
        "edu_id_register",
        format!("{:#010x}", vmm.r32(BAR0, ID)),
        "0x010000ed",
    );
    vmm.enable_bus_master();
    check("edu_factorial_10", vmm.factorial(10).to_string(), "3628800");
    let mem = Memory::new();
    if let Err(e) = vmm.client.dma_map(0, IOVA, GUEST_MEM, mem.fd.as_raw_fd()) {
        println!("DEVLEND-RESULT edu_dma_map=failed: {e:?}");
        std::process::exit(1);
    }
    println!("DEVLEND-RESULT edu_dma_map=ok");
    let wrong = vmm.dma_pages(&mem, 8, 5);
    check("edu_dma_wrong_bytes", wrong.to_string(), "0");
    let wrong = vmm.dma_pages(&mem, 3, 77);
    check("edu_dma_wrong_bytes_again", wrong.to_string(), "0");
    if failed {
        std::process::exit(1);
    }
}
