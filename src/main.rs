//! Thin entry point: parse, run, print the error chain once, exit with its code.

fn main() {
    let code = match reap_imatrix::cli::main(std::env::args_os().collect()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("reap-imatrix: error: {e:#}");
            reap_imatrix::error::exit_code_for(&e)
        }
    };
    std::process::exit(code);
}
